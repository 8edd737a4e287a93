"""Per-GPU memory of the persistent tensors of a run, estimated before anything is allocated, and measured after.

`estimate_memory` gives what one rank keeps for the whole run: the weights, one gradient per trainable
parameter (DDP keeps it in its buckets with `gradient_as_bucket_view`, so one copy) and the optimizer's state
and per-element work buffers, from its `OptimSpec.state_bytes_per_param`. Activations are not in it: they
depend on the micro-batch and the sequence length. Buffers bounded by a constant (1-bit LAMB's work piece,
SLAMB's chunk scratch) and O(1) entries (step counters, per-tensor scalars) are left out too.

`state_bytes` and `persistent_bytes` measure a built optimizer; the tests hold each spec's number to them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from optim._registry import OptimSpec, StateBytes, _options, _plain
from optim.base_optimizer import base_spec

GIB = 1 << 30
WARN_FRACTION = 0.9  # of the device's memory: above it the persistent part alone leaves too little for activations


def bytes_per_param(spec: OptimSpec, kwargs: Mapping[str, Any], world_size: int) -> float | None:
    """The optimizer's persistent bytes per trainable parameter element under config `kwargs` (over the
    class's signature defaults and the entry's own), for `world_size` ranks; None where the spec does not say."""
    value = spec.state_bytes_per_param
    if value is None or isinstance(value, int | float):
        return value
    per_param = value({**_options(spec.cls), **spec.defaults, **_plain(kwargs)}, world_size)
    return None if per_param is None else float(per_param)


def estimate_memory(model: nn.Module, spec: OptimSpec, kwargs: Mapping[str, Any], world_size: int,
                    half_copy_bytes: int = 0) -> dict[str, int]:
    """Bytes per rank of `weights`, `gradients`, `optimizer` (absent when the spec gives no number) and `total`.

    Gradients: one per trainable parameter, in the parameter's dtype. The optimizer's bytes per element are
    for fp32 parameters, as every optimizer here keeps its state in fp32. `half_copy_bytes`: O2's half-precision
    copy of the weights, which adds its size to the weights and again to the gradients.
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    estimate = {
        "weights": sum(p.numel() * p.element_size() for p in params) + half_copy_bytes,
        "gradients": sum(p.numel() * p.element_size() for p in trainable) + half_copy_bytes,
    }
    per_param = bytes_per_param(spec, kwargs, world_size)
    if per_param is not None:
        estimate["optimizer"] = round(per_param * sum(p.numel() for p in trainable))
    estimate["total"] = sum(estimate.values())
    return estimate


def memory_lines(estimate: Mapping[str, int], device_total: int | None) -> list[str]:
    """The start-up banner's memory line, and a warning line when the persistent part alone exceeds
    `WARN_FRACTION` of `device_total` (the device's memory in bytes; None off CUDA)."""
    optimizer = (f"optimizer state {_gib(estimate['optimizer'])}" if "optimizer" in estimate
                 else "optimizer state unknown")
    line = (f"memory per rank (persistent): weights {_gib(estimate['weights'])} + gradients "
            f"{_gib(estimate['gradients'])} + {optimizer} = {_gib(estimate['total'])}")
    line += f" of {_gib(device_total, 1)} (activations extra)" if device_total else " (activations extra)"
    lines = [line]
    if device_total and estimate["total"] > WARN_FRACTION * device_total:
        lines.append(f"warning: the persistent tensors alone take {estimate['total'] / device_total:.0%} of the "
                     f"device's {_gib(device_total, 1)}; activations will not fit: use more ranks, a smaller model "
                     "or an optimizer with less state")
    return lines


def _gib(n: int, digits: int = 2) -> str:
    return f"{n / GIB:.{digits}f} GiB"


# ------------------------------------------------------------------------------------------------ measured
def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the optimizer's state tensors, a wrapper's base optimizer included
    (SlowMo, JointSpar)."""
    seen: set[int] = set()
    return sum(_new_storage_bytes(value, seen)
               for opt in (optimizer, getattr(optimizer, "base", None)) if opt is not None
               for entry in opt.state.values() if isinstance(entry, dict)
               for value in entry.values() if isinstance(value, torch.Tensor))


def persistent_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages of every tensor the optimizer holds, in its state or in its attributes
    (the 1-bit family's error buffers and cached denominators), its parameters and their gradients excluded."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen = {_storage_id(t) for p in params for t in (p, p.grad) if t is not None}
    return sum(_new_storage_bytes(t, seen) for t in _held_tensors(optimizer, set()))


def _held_tensors(obj: Any, visited: set[int]) -> Iterator[torch.Tensor]:
    """Tensors reachable from `obj` through containers and objects of this package (not through `param_groups`,
    which holds the parameters)."""
    if id(obj) in visited:
        return
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _held_tensors(value, visited)
    elif isinstance(obj, list | tuple | set):
        for value in obj:
            yield from _held_tensors(value, visited)
    elif isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith("optim."):
        for key, value in vars(obj).items():
            if key not in ("param_groups", "comm"):
                yield from _held_tensors(value, visited)


def _new_storage_bytes(t: torch.Tensor, seen: set[int]) -> int:
    """`t`'s storage's bytes the first time that storage is seen, else 0."""
    key = _storage_id(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def _storage_id(t: torch.Tensor) -> int:
    """The identity of `t`'s storage: the same for every view of it, distinct on the meta device too (where every
    data pointer is 0)."""
    return t.untyped_storage()._cdata


# ------------------------------------------------------------------------------------------------ per spec
def onebit_family_bytes(flat_buffers: int) -> StateBytes:
    """`state_bytes_per_param` of a 1-bit family optimizer (`OneBitFamily`) with `flat_buffers` fp32 flat buffers
    (momentum, variance, ..., the cached denominator `sqrt(v) + eps`): plus its compression's error buffers, the
    worker's (one per element) and the server's (1/world of it), and the zero-variance mask (1 byte) if
    `mask_zero_variance`. The padding of the buckets (< world elements each) is left out."""
    def per_param(options: dict[str, Any], world_size: int) -> float:
        return 4.0 * (flat_buffers + 1 + 1 / world_size) + (1.0 if options["mask_zero_variance"] else 0.0)
    return per_param


def wrapper_bytes(own: float) -> StateBytes:
    """`state_bytes_per_param` of a wrapper (SlowMo, JointSpar): `own` bytes per element on top of its base's."""
    def per_param(options: dict[str, Any], world_size: int) -> float | None:
        base = bytes_per_param(base_spec(options["base"]), options["base_options"] or {}, world_size)
        return None if base is None else own + base
    return per_param
