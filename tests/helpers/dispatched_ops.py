"""Counting the tensor ops Python dispatches: on a GPU each costs host time (microseconds) whatever its size, so a
step whose count grows with the number of tensors is host-bound on models with hundreds of them.

Ops that a kernel calls internally (a foreach op's per-tensor fallback, a composite op's pieces) are not counted:
they run in C++, not through the Python step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(fn: Callable[[], object]) -> Counter[str]:
    """Ops dispatched from Python while `fn()` runs, by name (views included: each is a dispatch too)."""
    with _Counting() as mode:
        fn()
    return mode.ops


class _PerTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith(("aten._foreach_", "aten._fused_")):
            schema_args = func._schema.arguments
            named = {a.name: args[i] if i < len(args) else (kwargs or {}).get(a.name)
                     for i, a in enumerate(schema_args)}
            lists = [value for key, value in named.items() if key != "state_steps"
                     and isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor)]
            layouts = {tuple((t.shape, t.stride()) for t in tensors) for tensors in lists}
            if len(layouts) > 1:
                self.ops.append(name)
        return func(*args, **(kwargs or {}))


def per_tensor_foreach_ops(fn: Callable[[], object]) -> list[str]:
    """The foreach and fused ops dispatched while `fn()` runs whose tensor lists differ in shapes or strides
    position by position (a broadcast, a per-tensor 0-d factor): CUDA runs such an op as one kernel per tensor
    instead of one per list, so its launches grow with the number of tensors."""
    with _PerTensor() as mode:
        fn()
    return mode.ops
