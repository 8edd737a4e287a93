"""Turning the `data` config into this rank's tokenizer and resumable micro-batch loader."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from data import PretrainingLoader, build_demo_dataset, load_tokenizer
from optim.comm import Comm
from train.config import BatchGeometry

_CORPORA = {"demo": build_demo_dataset}


def build_text_loader(
    data_cfg: DictConfig, geometry: BatchGeometry, comm: Comm, seed: int, device: torch.device
) -> tuple[PretrainingLoader, Any]:
    """The tokenizer and this rank's loader; every rank builds the same instances from the same seed."""
    if data_cfg.name not in _CORPORA:
        raise ValueError(f"unknown data.name '{data_cfg.name}'; known: {', '.join(_CORPORA)}")
    tokenizer = load_tokenizer(data_cfg.vocab_path)
    dataset = _CORPORA[data_cfg.name](
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
    return loader, tokenizer
