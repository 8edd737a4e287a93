"""Mixed precision with native torch.amp: autocast to bf16 or fp16, and a GradScaler for fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum

import torch
from omegaconf import MISSING, DictConfig

from conf.checks import check_positive

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class PrecisionConfig:
    """Schema of conf/precision/*.yaml (the values and their meaning are there)."""

    dtype: Precision = MISSING  # autocast dtype; fp16 adds a GradScaler
    init_scale: float | None = MISSING  # fp16 loss scale at the start (null without loss scaling)
    growth_interval: int | None = MISSING  # fp16 steps without overflow before the scale doubles


def check_precision_config(cfg: DictConfig) -> None:
    """fp16's loss scaler needs a positive start and growth interval (raises `InvalidOption`)."""
    if cfg.dtype == "fp16":
        check_positive("init_scale", cfg.init_scale)
        check_positive("growth_interval", cfg.growth_interval)


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast region for the forward pass; fp32 runs without one."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_AUTOCAST_DTYPES[dtype])


def make_grad_scaler(cfg: DictConfig, device: torch.device) -> torch.amp.GradScaler:
    """A dynamic loss scaler for fp16; for bf16 and fp32 a disabled one that passes everything through."""
    if cfg.dtype != "fp16":
        return torch.amp.GradScaler(device.type, enabled=False)
    return torch.amp.GradScaler(device.type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
