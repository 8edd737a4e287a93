"""Turning the `data` config into this rank's training loader, held-out data and tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from data import PretrainingLoader, build_demo_dataset, load_tokenizer
from data.squad import SquadDataset, build_features, load_squad, load_squad_hub
from optim.comm import Comm
from train.config import BatchGeometry
from train.tasks import SquadEvalData


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


def build_squad_data(
    data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device
) -> TaskData:
    """SQuAD windows for training (this rank's share) and the dev set for evaluation on rank 0."""
    tokenizer = _load_any_tokenizer(data_cfg.vocab_path)
    if data_cfg.hf_dataset:
        train_examples = load_squad_hub(data_cfg.hf_dataset, "train")
        dev_examples = load_squad_hub(data_cfg.hf_dataset, "validation")
    else:
        train_examples, dev_examples = load_squad(data_cfg.train_file), load_squad(data_cfg.dev_file)
    windows = dict(max_seq_len=data_cfg.max_seq_len, doc_stride=data_cfg.doc_stride,
                   max_query_len=data_cfg.max_query_len)
    loader = PretrainingLoader(
        SquadDataset(build_features(train_examples, tokenizer, **windows)), geometry.micro_batch_size, comm.rank,
        comm.world_size, seed, num_workers=data_cfg.num_workers, pin_memory=device.type == "cuda",
        collate_fn=torch.utils.data.default_collate,
    )
    evaluation = None
    if comm.rank == 0:
        evaluation = SquadEvalData(dev_examples, build_features(dev_examples, tokenizer, **windows),
                                   data_cfg.eval_batch_size, data_cfg.n_best_size, data_cfg.max_answer_len)
    return TaskData(train=loader, eval=evaluation, tokenizer=tokenizer)


def _load_any_tokenizer(path: str | None) -> Any:
    """A vocab.txt (or the vendored vocab) through load_tokenizer, or a tokenizer directory (any HF BERT)."""
    if path is not None and Path(path).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer(path)


def build_image_data(
    data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device
) -> TaskData:
    """This rank's augmented (mixup) training loader and the held-out set; `digits` first writes its images."""
    from data.digits import write_digits_imagefolder
    from data.images import AugmentConfig, build_image_sets

    path = data_cfg.path
    if data_cfg.name == "digits":
        path = str(write_digits_imagefolder(path))
    augment = AugmentConfig(**{key: tuple(data_cfg[key]) if key in ("scale", "ratio", "mean", "std")
                               else data_cfg[key] for key in AugmentConfig.__dataclass_fields__})
    pin_memory = device.type == "cuda"
    dataset, collate, evaluation = build_image_sets(
        data_cfg.format, path, data_cfg.train_split, data_cfg.eval_split, augment, data_cfg.num_classes, seed,
        data_cfg.eval_batch_size, data_cfg.num_workers, pin_memory, data_cfg.image_key, data_cfg.label_key,
    )
    loader = PretrainingLoader(dataset, geometry.micro_batch_size, comm.rank, comm.world_size, seed,
                               num_workers=data_cfg.num_workers, pin_memory=pin_memory, collate_fn=collate)
    return TaskData(train=loader, eval=evaluation if comm.rank == 0 else None)


DataBuilder = Callable[[DictConfig, BatchGeometry, Comm, int, torch.device], TaskData]
_DATA: dict[str, DataBuilder] = {
    "demo": build_pretraining_data,
    "shards": build_prepared_data,
    "squad": build_squad_data,
    "images": build_image_data,
    "digits": build_image_data,
}


def build_data(data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device) -> TaskData:
    if data_cfg.name not in _DATA:
        raise ValueError(f"unknown data.name '{data_cfg.name}'; known: {', '.join(sorted(_DATA))}")
    return _DATA[data_cfg.name](data_cfg, geometry, comm, seed, device)
