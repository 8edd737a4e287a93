"""The value checks the optimizers' options share (the Adam four, switches): each optimizer's check starts with
them, in its constructor and, through the registry, on the config before any worker starts."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from core.options import check_non_negative, require


def check_adam_hyperparameters(options: Mapping[str, Any]) -> None:
    """The Adam family's `lr`, `betas`, `eps`, `weight_decay`: an `InvalidOption` naming the first bad one.

    The check of `adamw` and the first part of every other optimizer's check (constructors and config alike).
    """
    check_non_negative("lr", options["lr"])
    betas = options["betas"]
    require(isinstance(betas, Sequence) and len(betas) == 2 and all(0.0 <= beta < 1.0 for beta in betas),
            "betas", betas, "must be two values in [0, 1)")
    check_non_negative("eps", options["eps"])
    check_non_negative("weight_decay", options["weight_decay"])


def check_flags(options: Mapping[str, Any], *keys: str) -> None:
    """Options that are switches must be true or false (a string or a pair is some other optimizer's option)."""
    for key in keys:
        require(isinstance(options[key], bool), key, options[key], "must be true or false")


_BOTH_FUSIONS = "and compiled are two ways to fuse the step: choose one"
# The oldest GPU that `triton: null` gives the kernels: the tests compile every launch for sm_80 (A100) and sm_90, and
# they ran on an H100; a V100 (sm_70) takes the aten ops unless `triton: true` asks for the kernels.
KERNELS_FROM_CAPABILITY = (8, 0)


def check_triton(options: Mapping[str, Any]) -> None:
    """`triton` (an optimizer's own Triton kernels, `optim._triton`): true, exclusive with `compiled` and refused
    where it cannot run (no triton, or neither a GPU nor Triton's interpreter); false; or null, the kernels wherever
    they can run (`use_triton`)."""
    require(options["triton"] is None or isinstance(options["triton"], bool), "triton", options["triton"],
            "must be true, false or null (the kernels on CUDA tensors, the aten ops elsewhere)")
    if options["triton"]:
        require(not options.get("compiled"), "triton", True, _BOTH_FUSIONS)
        refusal = triton_refusal(None)
        require(refusal is None, "triton", True, f"{refusal}; set it to false")


def use_triton(setting: bool | None, device: torch.device, owner: str, compiled: bool = False,
               obstacle: str | None = None) -> bool:
    """Whether `owner`'s steps of tensors on `device` take its Triton kernels, by its `triton` option.

    True: yes, or a ValueError naming why they cannot (`triton_refusal`, `compiled` set too, or the optimizer's own
    `obstacle`: a dtype, a layout). False: no. None: where they can run on a GPU they were built for, CUDA tensors
    of compute capability `KERNELS_FROM_CAPABILITY` or newer (not the interpreter's host tensors, nor the meta
    tensors of a count), with neither; elsewhere the aten ops.
    """
    if setting is False:
        return False
    refusal = triton_refusal(device) or (_BOTH_FUSIONS if compiled else obstacle)
    if setting is None:
        return (refusal is None and device.type == "cuda"
                and torch.cuda.get_device_capability(device) >= KERNELS_FROM_CAPABILITY)
    if refusal is not None:
        raise ValueError(f"{owner}(triton=True) {refusal}; set triton=False")
    return True


def triton_refusal(device: torch.device | None) -> str | None:
    """Why Triton kernels cannot step tensors on `device` (None: on this machine at all), or None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (torch's Linux wheels bring it)"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"  # host tensors through Triton's interpreter
    if device is None and not (interpreted or torch.cuda.is_available()):
        return "needs a CUDA GPU (its kernels are Triton's)"
    if device is not None and device.type not in ("cuda", "meta") and not interpreted:
        return f"needs CUDA tensors (its kernels are Triton's), not {device.type} ones"
    return None
