"""Elementwise ops with a factor per tensor, one Triton launch per list (`optim._triton`'s address tables).

torch's multi-tensor ops launch a kernel per tensor when each tensor has a factor of its own on the device (a list of
0-d tensors): 1-bit LAMB's scaling of every momentum into the compression and out of it, and its frozen-coefficient
update, were 1,194 of its 1,609 launches at BERT-Large. Here the factors are one vector on the device and each
program reads its tensor's factor. Each op is a torch custom op (counted by `benchmarks.optim.step_cost`; meta
tensors pass through). This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import DTYPES, block_of, kernel_op, load_block, multi_tensor_launch


@triton.jit
def _per_tensor(addresses, count, tensor_of_block, first_element, numels, factors, DIVIDE: tl.constexpr,
                DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    out_at, out = load_block(addresses, tensor, offsets, inside, DTYPE, ALIGNED)
    factor = tl.load(factors + tensor)
    if DIVIDE:
        out = out / factor
    else:
        _, x = load_block(addresses, count + tensor, offsets, inside, DTYPE, ALIGNED)
        out = out + x * factor
    tl.store(out_at + offsets, out.to(DTYPE), mask=inside)


def _launch(outs: list[Tensor], ins: list[Tensor], factors: Tensor, divide: bool) -> None:
    if any(t.dtype != outs[0].dtype or not t.is_contiguous() for t in (*outs, *ins)) or factors.numel() != len(outs):
        raise ValueError("per-tensor Triton ops take contiguous tensors of one dtype and a factor per tensor")
    launch = multi_tensor_launch(outs, ins)
    if launch.programs:
        _per_tensor[(launch.programs,)](*launch.head, factors.float().contiguous(), DIVIDE=divide,
                                        DTYPE=DTYPES[outs[0].dtype], BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)


@kernel_op("slamb_optim::per_tensor_multiply_add", mutates_args=("outs",))
def per_tensor_multiply_add(outs: list[Tensor], ins: list[Tensor], factors: Tensor) -> None:
    """`outs[t] += factors[t] * ins[t]` for every tensor t (the factor rounded to the tensors' dtype first, as a 0-d
    factor of torch's foreach op is)."""
    if len(ins) != len(outs):
        raise ValueError(f"per_tensor_multiply_add: {len(outs)} outputs, {len(ins)} inputs")
    if outs:
        _launch(outs, ins, factors, divide=False)


@per_tensor_multiply_add.register_fake
def _(outs, ins, factors):
    return None


@kernel_op("slamb_optim::per_tensor_divide", mutates_args=("outs",))
def per_tensor_divide(outs: list[Tensor], factors: Tensor) -> None:
    """`outs[t] /= factors[t]` for every tensor t."""
    if outs:
        _launch(outs, [], factors, divide=True)


@per_tensor_divide.register_fake
def _(outs, factors):
    return None
