"""Counting the tensor ops Python dispatches: on a GPU each costs host time (microseconds) whatever its size, so a
step whose count grows with the number of tensors is host-bound on models with hundreds of them.

Ops that a kernel calls internally (a foreach op's per-tensor fallback, a composite op's pieces) are not counted:
they run in C++, not through the Python step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

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
