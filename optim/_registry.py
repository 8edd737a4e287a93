"""The optimizer registry: a frozen `OptimSpec` per name, and `build_optimizer`, where names are resolved."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from optim.param_groups import param_groups_weight_decay


@dataclass(frozen=True)
class OptimSpec:
    """What the trainer needs to know about an optimizer besides its keyword arguments."""

    name: str  # same string as conf/optim/<name>.yaml and its `name:` field
    cls: type[torch.optim.Optimizer]
    grad_sync: Literal["ddp", "self"]  # who makes gradients global: DDP all-reduce, or the optimizer itself
    description: str


_OPTIMIZERS: dict[str, OptimSpec] = {}


def register_optimizer(spec: OptimSpec) -> OptimSpec:
    """Add `spec` under `spec.name`; a second spec with the same name is an error."""
    if spec.name in _OPTIMIZERS:
        raise ValueError(f"optimizer '{spec.name}' is registered twice")
    if spec.grad_sync not in ("ddp", "self"):
        raise ValueError(f"optimizer '{spec.name}': grad_sync={spec.grad_sync!r} must be 'ddp' or 'self'")
    _OPTIMIZERS[spec.name] = spec
    return spec


def list_optimizers() -> list[str]:
    return sorted(_OPTIMIZERS)


def get_optimizer_spec(name: str) -> OptimSpec:
    try:
        return _OPTIMIZERS[name]
    except KeyError:
        known = ", ".join(list_optimizers())
        raise ValueError(f"unknown optimizer '{name}'; known optimizers: {known}") from None


def build_optimizer(
    model: nn.Module, name: str, kwargs: dict[str, Any], comm: Any = None
) -> torch.optim.Optimizer:
    """Build optimizer `name` over `model`'s trainable parameters, from config kwargs.

    `weight_decay` goes to the decay group only (biases and norm weights get 0, see `param_groups.py`); the
    other kwargs go to the class as they are. None values are passed on, not dropped: `max_grad_norm: null`
    means "off", not "the class default". Optimizers that synchronise themselves also get `comm`.
    """
    spec = get_optimizer_spec(name)
    kwargs = dict(kwargs)
    options = inspect.signature(spec.cls).parameters
    reserved = {"params", "comm"}
    unknown = sorted(k for k in kwargs if k not in options or k in reserved)
    if unknown:
        allowed = ", ".join(k for k in options if k not in reserved)
        raise ValueError(f"'{unknown[0]}' is not an option of optimizer '{name}'; options: {allowed}")
    class_default = options["weight_decay"].default if "weight_decay" in options else 0.0
    weight_decay = kwargs.pop("weight_decay", class_default)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}  # YAML lists: betas
    groups = param_groups_weight_decay(model, weight_decay)
    if spec.grad_sync == "self":
        kwargs["comm"] = comm
    return spec.cls(groups, **kwargs)
