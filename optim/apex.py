"""NVIDIA apex's fused optimizers as registry entries: `apex_lamb` (FusedLAMB) and `apex_adam` (FusedAdam).

apex is optional. It ships in NGC PyTorch containers or builds from its GitHub source with its CUDA extensions
(`--cpp_ext --cuda_ext`); the package named `apex` on PyPI is unrelated. Without it, or without a GPU (the
fused kernels run on CUDA tensors only), choosing these entries fails at compose time in one line. The
signatures below are the options the entries expose; each builder hands them to apex's class unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from core.apex import NVIDIA_APEX_HINT, missing_nvidia_apex
from core.options import InvalidOption
from optim._registry import OptimSpec, list_optimizers, register_optimizer
from optim.option_checks import check_adam_hyperparameters

APEX_OPTIMIZERS = ("apex_lamb", "apex_adam")


def _check_apex(options: dict[str, Any], name: str) -> None:
    missing = missing_nvidia_apex("apex.optimizers", "amp_C")  # amp_C: apex's compiled multi-tensor kernels
    if missing is not None:
        raise InvalidOption("name", f"{NVIDIA_APEX_HINT}; here {missing}", name)
    check_adam_hyperparameters(options)


def apex_fused_lamb(
    params: Any,
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.01,
    bias_correction: bool = True,
    max_grad_norm: float = 1.0,
    use_nvlamb: bool = False,
) -> torch.optim.Optimizer:
    """apex.optimizers.FusedLAMB (NVIDIA BERT's optimizer; `optim.LAMB` follows its math on any device)."""
    from apex.optimizers import FusedLAMB

    return FusedLAMB(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction, max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)


def apex_fused_adam(
    params: Any,
    lr: float = 1e-3,
    betas: Sequence[float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    adam_w_mode: bool = True,
) -> torch.optim.Optimizer:
    """apex.optimizers.FusedAdam (AdamW with `adam_w_mode`, the default)."""
    from apex.optimizers import FusedAdam

    return FusedAdam(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                     bias_correction=bias_correction, adam_w_mode=adam_w_mode)


register_optimizer(OptimSpec(
    "apex_lamb", apex_fused_lamb, "ddp", check=lambda options: _check_apex(options, "apex_lamb"),
    state_bytes_per_param=8.0,  # m, v in fp32
    description="NVIDIA apex FusedLAMB: LAMB in fused multi-tensor CUDA kernels (needs apex and a GPU)",
))
register_optimizer(OptimSpec(
    "apex_adam", apex_fused_adam, "ddp", check=lambda options: _check_apex(options, "apex_adam"),
    state_bytes_per_param=8.0,  # m, v in fp32
    description="NVIDIA apex FusedAdam: Adam/AdamW in fused multi-tensor CUDA kernels (needs apex and a GPU)",
))


def runnable_optimizers() -> list[str]:
    """Every registered optimizer this machine can build: apex's entries need NVIDIA apex and a GPU (elsewhere
    their one-line refusal is what a run gets)."""
    missing = missing_nvidia_apex("apex.optimizers", "amp_C") is not None
    return [name for name in list_optimizers() if not (missing and name in APEX_OPTIMIZERS)]
