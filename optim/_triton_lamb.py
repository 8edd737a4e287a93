"""LAMB's update of trust-ratio tensors in three Triton kernels per chunk, however many tensors it holds.

torch has fused kernels for Adam and SGD but none for LAMB, whose trust ratio needs each tensor's norms before any
of its weights change. Its aten form is a fused Adam pass, foreach norms and a multiply-add by per-tensor 0-d
factors, which torch's multi-tensor kernels cannot take in one launch: 14 tensor-sized reads and writes, and a
kernel per tensor. Here (`optim._triton`'s multi-tensor kernels):

1. `moments_and_block_sums`: reads g, m, v and w, writes m and v, and each block's sums of w^2 and u^2 (6 reads and
   writes);
2. `trust_factors`: each tensor's blocks' sums added into its `-lr * ratio`;
3. `lamb_apply`: reads w, m and v, forms u again and writes w (4).

Ten reads and writes, as `compiled=True` moves, in three launches. This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import (
    DTYPES,
    block_of,
    kernel_op,
    load_block,
    moments_and_block_sums,
    multi_tensor_launch,
    trust_factors,
)


@triton.jit
def _apply(addresses, count, tensor_of_block, first_element, numels, factors, scale, root_correction2, eps,
           weight_decay, DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, DTYPE, ALIGNED)
    _, m = load_block(addresses, count + tensor, offsets, inside, DTYPE, ALIGNED)
    _, v = load_block(addresses, 2 * count + tensor, offsets, inside, DTYPE, ALIGNED)
    u = (m * scale) / (tl.sqrt(v) / root_correction2 + eps) + weight_decay * w  # as `moments_and_block_sums` forms it
    tl.store(w_at + offsets, (w + tl.load(factors + tensor) * u).to(DTYPE), mask=inside)


@kernel_op("slamb_optim::lamb_apply", mutates_args=("params",))
def lamb_apply(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], factors: Tensor,
               scale: float, bias_correction2: float, eps: float, weight_decay: float) -> None:
    """`w += factor * u` per tensor, the update u formed again from w and the moments `moments_and_block_sums` wrote."""
    launch = multi_tensor_launch(params, exp_avgs, exp_avg_sqs)
    if launch.programs:
        _apply[(launch.programs,)](*launch.head, factors, scale, bias_correction2 ** 0.5, eps, weight_decay,
                                   DTYPE=DTYPES[params[0].dtype], BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)


@lamb_apply.register_fake
def _(params, exp_avgs, exp_avg_sqs, factors, scale, bias_correction2, eps, weight_decay):
    return None


def triton_lamb_update_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                        *, grad_divisor: Tensor | None, lr: float, corrections: tuple[float, float], beta1: float,
                        beta2: float, eps: float, weight_decay: float, max_ratio: float | None) -> None:
    """LAMB's update of one chunk of trust-ratio tensors (one device and dtype, dense) in the three kernels."""
    scale, bias_correction2 = 1.0 / corrections[0], corrections[1]
    partials = moments_and_block_sums(params, grads, exp_avgs, exp_avg_sqs, [], grad_divisor, beta1, beta2, scale,
                                      bias_correction2, eps, weight_decay)
    factors = trust_factors(partials, [p.numel() for p in params], lr, max_ratio)
    lamb_apply(params, exp_avgs, exp_avg_sqs, factors, scale, bias_correction2, eps, weight_decay)
