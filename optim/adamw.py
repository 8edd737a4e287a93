"""`torch.optim.AdamW`, registered as `adamw`: the decoupled-weight-decay Adam baseline, in torch's fused kernel."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from optim._registry import OptimSpec, register_optimizer
from optim.option_checks import check_adam_hyperparameters


def adamw(params: Any, **options: Any) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, **options)`, with `fused=True` unless the options choose `fused` or `foreach`
    (or `differentiable`), when torch has its fused kernel for every parameter (floating point, on the CPU or a
    GPU; not on the meta device).

    The fused kernel steps a whole param group in one pass, reading and writing each element once; torch's
    default takes one kernel per operation (and per tensor, on the CPU). It rounds apart from those within a
    few units in the last place per step. A checkpoint keeps the `fused` it was written with, so a run resumes
    on the path it started on.

    The fused step could also take the loss scaler's overflow check (`_step_supports_amp_scaling`): it would then
    run on every step and skip inside the kernel, where the trainer could not count the skip. Turned off, the
    scaler decides and skips the step itself, as for every other optimizer.
    """
    params = [dict(item, params=_listed(item["params"])) if isinstance(item, dict) else item for item in params]
    if options.get("fused") is None and not options.get("foreach") and not options.get("differentiable"):
        options["fused"] = _fused_kernel_covers(params)
    optimizer = torch.optim.AdamW(params, **options)
    optimizer._step_supports_amp_scaling = False
    return optimizer


adamw.__signature__ = inspect.signature(torch.optim.AdamW)  # its options are AdamW's, checked against this


def _listed(params: Any) -> list[Any]:
    """A param group's `params` as torch reads them (a tensor or an iterable), in a list that can be read twice."""
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _fused_kernel_covers(params: list[Any]) -> bool:
    """Whether torch's fused AdamW runs on every tensor of `params` (tensors, named tensors or param groups)."""
    items = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]
    devices = _get_fused_kernels_supported_devices()
    return all(t.is_floating_point() and t.device.type in devices for t in tensors)


register_optimizer(OptimSpec(
    "adamw", adamw, "ddp", check=check_adam_hyperparameters,  # torch's constructor checks them too
    state_bytes_per_param=lambda options, world_size: 12.0 if options["amsgrad"] else 8.0,  # m, v (, max v)
    description="torch.optim.AdamW (Loshchilov & Hutter, arXiv 1711.05101): Adam with decoupled weight decay",
))
