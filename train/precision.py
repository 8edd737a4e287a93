"""Mixed precision with native torch.amp: autocast to bf16 or fp16, and a GradScaler for fp16."""

from __future__ import annotations

import contextlib

import torch
from omegaconf import DictConfig

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
