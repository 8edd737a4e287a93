"""Mixed precision with native torch.amp: autocast to bf16 or fp16 over fp32 weights, or (O2, `precision.weights=half`)
bf16/fp16 weights with fp32 masters (`train.half_weights`); a GradScaler for fp16; or fp32 matmuls in TF32. And the
switch to deterministic kernels (`trainer.deterministic`).

NVIDIA apex's `amp` was removed upstream; mixed precision here is torch.amp's on every path.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from omegaconf import MISSING, DictConfig

from core.options import check_choice, check_positive, require

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
WEIGHTS = ("fp32", "half")


@dataclass
class PrecisionConfig:
    """Schema of conf/precision/*.yaml (the values and their meaning are there)."""

    dtype: str = MISSING  # fp32 | tf32 (fp32 weights, TF32 matmuls) | bf16 | fp16 (adds a GradScaler)
    weights: str = MISSING  # fp32 (autocast over them) | half (O2: weights and activations in dtype, fp32 masters)
    init_scale: float | None = MISSING  # fp16 loss scale at the start (null without loss scaling)
    growth_interval: int | None = MISSING  # fp16 steps without overflow before the scale doubles
    max_consecutive_skips: int | None = MISSING  # fp16 overflowing steps in a row that stop the run


def check_precision_config(cfg: DictConfig) -> None:
    """A known dtype; half weights need a half dtype; fp16's loss scaler needs a positive start and growth interval,
    and a limit of overflowing steps in a row that lets the scale fall from its start to 1 before the run is stopped
    for it (raises `InvalidOption`)."""
    check_choice("dtype", cfg.dtype, PRECISIONS)
    check_choice("weights", cfg.weights, WEIGHTS)
    require(cfg.weights == "fp32" or cfg.dtype in HALF_DTYPES, "weights", cfg.weights,
            f"needs a half dtype, not precision.dtype={cfg.dtype}: use precision=bf16_o2 or precision=fp16_o2")
    if cfg.dtype == "fp16":
        check_positive("init_scale", cfg.init_scale)
        check_positive("growth_interval", cfg.growth_interval)
        check_positive("max_consecutive_skips", cfg.max_consecutive_skips)
        halvings = math.ceil(math.log2(cfg.init_scale)) if cfg.init_scale > 1 else 0
        require(cfg.max_consecutive_skips >= halvings, "max_consecutive_skips", cfg.max_consecutive_skips,
                f"would stop the run before its loss scale fell from precision.init_scale={cfg.init_scale:g} to 1 "
                f"(each overflow halves it): set it to at least {halvings}")


def set_matmul_precision(dtype: str) -> None:
    """TF32 for fp32 matmuls and convolutions under `tf32` (Ampere and newer GPUs; no effect on CPU), IEEE fp32
    otherwise: autocast regions run in bf16/fp16 anyway, and fp32 means fp32."""
    tf32 = dtype == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels (`trainer.deterministic=true`), so a resumed GPU run repeats the loss series bit for bit.

    Sets `torch.use_deterministic_algorithms`, cuDNN's deterministic mode without autotuning, and cuBLAS's
    workspace (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, unless already set), which torch reads once, when it makes its
    first cuBLAS handle: call this before the first CUDA matmul. Costs: a slower step (deterministic scatter and
    index_add in the embeddings' backward, no cuDNN autotuning), a cuBLAS workspace of 8 x 4 MiB per stream, and an
    error from any op that has no deterministic kernel. Off, only the switches are cleared (cuDNN autotuning is left
    as it was).
    """
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast region for the forward pass; fp32 and tf32 run without one."""
    if dtype not in HALF_DTYPES:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=HALF_DTYPES[dtype])


def half_weights_dtype(cfg: DictConfig) -> torch.dtype | None:
    """The dtype of O2's half-precision weights (`precision.weights=half`), None under autocast."""
    return HALF_DTYPES[cfg.dtype] if cfg.weights == "half" else None


def training_autocast(cfg: DictConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The training forward's region: autocast over fp32 weights, none over O2's half ones (they are half already;
    evaluation reads the fp32 masters, under `autocast`)."""
    return contextlib.nullcontext() if cfg.weights == "half" else autocast(cfg.dtype, device)


def make_grad_scaler(cfg: DictConfig, device: torch.device) -> torch.amp.GradScaler:
    """A dynamic loss scaler for fp16; for the others a disabled one that passes everything through."""
    if cfg.dtype != "fp16":
        return torch.amp.GradScaler(device.type, enabled=False)
    return torch.amp.GradScaler(device.type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)


def load_scaler_state(scaler: torch.amp.GradScaler, state: dict) -> None:
    """A checkpoint's loss scale, across a change of precision: a checkpoint without one (bf16/fp32 write `{}`)
    leaves an fp16 run's scaler fresh at `init_scale`, and a run without loss scaling ignores an fp16 one's."""
    if scaler.is_enabled() and state:
        scaler.load_state_dict(state)
