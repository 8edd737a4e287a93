"""1-bit LAMB's compression-stage update, after the momentum's all-reduce, in three Triton kernels per param group
(`optim._triton`'s address tables), however many tensors it holds.

The aten ops take about ten passes over memory and a launch per tensor for the per-tensor factors: the momentum
unscaled, the fresh variance refreshed from the reconstructed gradient, the ratio maxima, the update formed, its
norms, then applied. Here, as `compiled=True` fuses them (`optim.onebit_lamb._refresh_and_norms`):

1. `refresh_and_block_stats`: reads m, the old momentum, the fresh variance, the frozen denominator and w; writes m
   (unscaled) and the fresh variance; per block the largest `denom / (sqrt(v_fresh) + eps)` and the sums of squares
   of `m / denom` and of the update `m / denom + weight_decay w` (8 reads and writes);
2. `tensor_stats`: those per tensor, in a fixed order (no atomic adds);
3. `onebit_lamb_apply`: reads w, m and the denominator, forms the update again and writes w (4).

This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import (
    SUM_BLOCK,
    block_of,
    kernel_op,
    load_block,
    multi_tensor_launch,
)


@triton.jit
def _refresh_and_stats(addresses, count, tensor_of_block, first_element, numels, scaling, partials, total_blocks,
                       momentum_weight, beta2, eps, weight_decay, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    m_at, m = load_block(addresses, tensor, offsets, inside, tl.float32, ALIGNED)
    _, old = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    fresh_at, fresh = load_block(addresses, 2 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, denom = load_block(addresses, 3 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    denom = tl.where(inside, denom, 1.0)  # past the tensor's end: no 0 / 0
    _, w = load_block(addresses, 4 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    m = m / tl.load(scaling + tensor)
    tl.store(m_at + offsets, m, mask=inside)
    gradient = m - (m - old) * (1.0 - momentum_weight)  # torch's lerp(old, m, weight) for a weight >= 0.5
    fresh = fresh + beta2 * (gradient * gradient - fresh)  # lerp(fresh, g^2, 1 - beta2): `beta2` is 1 - beta2 here
    tl.store(fresh_at + offsets, fresh, mask=inside)
    ratio = tl.where(inside, denom / (tl.sqrt(fresh) + eps), 0.0)
    prelim = tl.where(inside, m / denom, 0.0)
    update = prelim + weight_decay * w
    block = tl.program_id(0)
    tl.store(partials + block, tl.max(ratio, axis=0))
    tl.store(partials + total_blocks + block, tl.sum(prelim * prelim, axis=0))
    tl.store(partials + 2 * total_blocks + block, tl.sum(update * update, axis=0))


@triton.jit
def _tensor_stats(partials, total_blocks, first_block, out, count, SUM_BLOCK: tl.constexpr):
    tensor = tl.program_id(0)
    first = tl.load(first_block + tensor)
    last = tl.load(first_block + tensor + 1)
    maximum = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    prelim = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    update = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(first, last, SUM_BLOCK):
        at = start + tl.arange(0, SUM_BLOCK)
        inside = at < last
        maximum = tl.maximum(maximum, tl.load(partials + at, mask=inside, other=0.0))
        prelim += tl.load(partials + total_blocks + at, mask=inside, other=0.0)
        update += tl.load(partials + 2 * total_blocks + at, mask=inside, other=0.0)
    tl.store(out + tensor, tl.max(maximum, axis=0))
    tl.store(out + count + tensor, tl.sqrt(tl.sum(prelim, axis=0)))
    tl.store(out + 2 * count + tensor, tl.sqrt(tl.sum(update, axis=0)))


@triton.jit
def _apply(addresses, count, tensor_of_block, first_element, numels, steps, weight_decay, BLOCK: tl.constexpr,
           ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, tl.float32, ALIGNED)
    _, m = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, denom = load_block(addresses, 2 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    update = m / tl.where(inside, denom, 1.0) + weight_decay * w
    tl.store(w_at + offsets, w + tl.load(steps + tensor) * update, mask=inside)


def _check(*lists: list[Tensor]) -> None:
    if any(t.dtype != torch.float32 or not t.is_contiguous() for tensors in lists for t in tensors):
        raise ValueError("1-bit LAMB's Triton kernels take contiguous fp32 tensors")


@kernel_op("slamb_optim::onebit_lamb_refresh_and_stats", mutates_args=("exp_avgs", "fresh"))
def refresh_and_stats(exp_avgs: list[Tensor], olds: list[Tensor], fresh: list[Tensor], denoms: list[Tensor],
                      params: list[Tensor], scaling: Tensor, momentum_weight: float, beta2: float, eps: float,
                      weight_decay: float) -> Tensor:
    """The momenta divided by their `scaling`, the fresh variances moved by the gradient reconstructed from the old
    and new momenta (`lerp(old, m, momentum_weight)`), and per tensor (a column of a (3, tensors) float32 tensor) the
    largest `denom / (sqrt(v_fresh) + eps)`, the norm of `m / denom` and that of `m / denom + weight_decay w`."""
    _check(exp_avgs, olds, fresh, denoms, params)
    device, count = exp_avgs[0].device, len(exp_avgs)
    launch = multi_tensor_launch(exp_avgs, olds, fresh, denoms, params)
    partials = torch.empty((3, launch.programs), dtype=torch.float32, device=device)
    stats = torch.empty((3, count), dtype=torch.float32, device=device)
    if launch.programs:
        _refresh_and_stats[(launch.programs,)](
            *launch.head, scaling.float().contiguous(), partials, launch.programs, momentum_weight, 1.0 - beta2, eps,
            weight_decay, BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)
        _tensor_stats[(count,)](partials, launch.programs, launch.first_block, stats, count, SUM_BLOCK=SUM_BLOCK)
    return stats


@refresh_and_stats.register_fake
def _(exp_avgs, olds, fresh, denoms, params, scaling, momentum_weight, beta2, eps, weight_decay):
    return exp_avgs[0].new_empty((3, len(exp_avgs)), dtype=torch.float32)


@kernel_op("slamb_optim::onebit_lamb_apply", mutates_args=("params",))
def onebit_lamb_apply(params: list[Tensor], exp_avgs: list[Tensor], denoms: list[Tensor], steps: Tensor,
                      weight_decay: float) -> None:
    """`w += steps[t] * (m / denom + weight_decay w)` for every tensor t."""
    _check(params, exp_avgs, denoms)
    launch = multi_tensor_launch(params, exp_avgs, denoms)
    if launch.programs:
        _apply[(launch.programs,)](*launch.head, steps.float().contiguous(), weight_decay, BLOCK=_triton.BLOCK,
                                   ALIGNED=launch.aligned)


@onebit_lamb_apply.register_fake
def _(params, exp_avgs, denoms, steps, weight_decay):
    return None
