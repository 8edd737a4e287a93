"""`optim._triton.KernelOp`: a kernel's launcher runs as a torch custom op where something needs the op (a dispatch
mode that counts it, grad mode), and straight otherwise, with the mutated tensors' versions bumped either way."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")
from optim._triton import kernel_op

CALLS: list[str] = []


@kernel_op("slamb_optim_test::scale_", mutates_args=("xs",))
def scale_(xs: list[Tensor], factor: float) -> None:
    CALLS.append("launcher")
    for x in xs:
        x.mul_(factor)


@scale_.register_fake
def _(xs, factor):
    CALLS.append("fake")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_a_step_calls_the_launcher_straight_and_bumps_the_versions():
    xs = [torch.ones(3), torch.ones(2)]
    versions = [x._version for x in xs]
    CALLS.clear()
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(scale_, "op", None)  # not called
        scale_(xs, 2.0)
    assert CALLS == ["launcher"]
    assert all(torch.equal(x, torch.full_like(x, 2.0)) for x in xs)
    assert all(x._version > v for x, v in zip(xs, versions, strict=True))


def test_a_dispatch_mode_and_grad_mode_see_the_op():
    xs = [torch.ones(3)]
    with torch.no_grad(), _Ops() as ops:
        scale_(xs, 2.0)
    assert ops.names == ["slamb_optim_test::scale_"]
    CALLS.clear()
    scale_(xs, 2.0)  # grad mode: autograd checks the mutation through the op
    assert CALLS == ["launcher"] and torch.equal(xs[0], torch.full((3,), 4.0))


def test_meta_tensors_take_the_fake():
    CALLS.clear()
    with torch.no_grad():
        scale_([torch.empty(3, device="meta")], 2.0)
    assert CALLS == ["fake"]
