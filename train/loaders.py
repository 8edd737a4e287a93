"""Turning the `data` config into this rank's training loader, held-out data and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig

from data import PretrainingLoader, build_demo_dataset, load_tokenizer
from optim.comm import Comm
from train.config import BatchGeometry


@dataclass
class TaskData:
    """What the trainer needs from a data option."""

    train: Any  # an endless, resumable micro-batch iterator with state_dict(), samples_per_epoch
    eval: Any | None = None  # held-out data for the task's evaluate(), on rank 0
    tokenizer: Any | None = None  # exported beside text models


def build_pretraining_data(
    data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device
) -> TaskData:
    """The tokenizer and this rank's loader; every rank builds the same instances from the same seed."""
    tokenizer = load_tokenizer(data_cfg.vocab_path)
    dataset = build_demo_dataset(
        tokenizer,
        max_seq_len=data_cfg.max_seq_len,
        max_predictions=data_cfg.max_predictions,
        dupe_factor=data_cfg.dupe_factor,
        seed=seed,
        masking=data_cfg.masking,
        masked_lm_prob=data_cfg.masked_lm_prob,
        short_seq_prob=data_cfg.short_seq_prob,
    )
    loader = PretrainingLoader(
        dataset, geometry.micro_batch_size, comm.rank, comm.world_size, seed,
        num_workers=data_cfg.num_workers, pin_memory=device.type == "cuda",
    )
    return TaskData(train=loader, tokenizer=tokenizer)


def build_prepared_data(
    data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device
) -> TaskData:
    """This rank's loader over shards from `python -m data.prepare` (data.path), checked against the config.

    data.vocab_path null means the vocabulary stored with the shards; an explicit one must match its sha256.
    """
    from data.shards import PREPARED_KEYS, VOCAB_NAME, load_prepared_dataset, resolve_phase_dir

    directory = resolve_phase_dir(data_cfg.path, data_cfg.max_seq_len)
    vocab_path = data_cfg.vocab_path or directory / VOCAB_NAME
    tokenizer = load_tokenizer(vocab_path)
    dataset = load_prepared_dataset(directory, tokenizer, vocab_path, seed=seed,
                                    **{key: data_cfg[key] for key in PREPARED_KEYS})
    loader = PretrainingLoader(
        dataset, geometry.micro_batch_size, comm.rank, comm.world_size, seed,
        num_workers=data_cfg.num_workers, pin_memory=device.type == "cuda",
        shard_sizes=dataset.instances.shard_sizes,  # shard-blocked shuffle: O(#shards) order memory
    )
    return TaskData(train=loader, tokenizer=tokenizer)


DataBuilder = Callable[[DictConfig, BatchGeometry, Comm, int, torch.device], TaskData]
_DATA: dict[str, DataBuilder] = {"demo": build_pretraining_data, "shards": build_prepared_data}


def build_data(data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device) -> TaskData:
    if data_cfg.name not in _DATA:
        raise ValueError(f"unknown data.name '{data_cfg.name}'; known: {', '.join(sorted(_DATA))}")
    return _DATA[data_cfg.name](data_cfg, geometry, comm, seed, device)
