"""0/1 Adam's sync step around its compressed all-reduce, in two Triton kernels per param group (`optim._triton`'s
address tables), however many tensors it holds.

The aten ops (`ZeroOneAdam._step_and_sync_fused`) take about 13 to 17 passes over memory and, at BERT-Large, about
95 launches for the momentum, the accumulated update fed into the worker error and the new weights. Here, as
`compiled=True` fuses them (`optim.zero_one_adam._sync_error_`, `_sync_weights_`):

1. `sync_error`: reads w, g, m, the anchor w_a, the denominator d and the error; writes m = lerp(m, g, 1 - beta1)
   and error += (w - w_a) d - lr m - lr wd w d (8 reads and writes; the weights are left alone: the sync
   overwrites them);
2. `sync_weights`, after the all-reduce has decoded m = -q_bar / sum(lr): w = w_a = w_a - sum(lr) m / d (5).

This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import block_of, kernel_op, load_block, multi_tensor_launch


@triton.jit
def _sync_error(addresses, count, tensor_of_block, first_element, numels, weight, lr, decay, HAS_DECAY: tl.constexpr,
                LERP_FROM_END: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    _, w = load_block(addresses, tensor, offsets, inside, tl.float32, ALIGNED)
    _, g = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    m_at, m = load_block(addresses, 2 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, anchor = load_block(addresses, 3 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, d = load_block(addresses, 4 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    error_at, error = load_block(addresses, 5 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    if LERP_FROM_END:  # torch's lerp(m, g, weight): from the end for a weight >= 0.5
        m = g - (g - m) * (1.0 - weight)
    else:
        m = m + weight * (g - m)
    tl.store(m_at + offsets, m, mask=inside)
    if HAS_DECAY:
        error = error + decay * w * d  # `decay` is -lr * weight_decay
    error = error + (w - anchor) * d
    error = error + m * -lr
    tl.store(error_at + offsets, error, mask=inside)


@triton.jit
def _sync_weights(addresses, count, tensor_of_block, first_element, numels, lr_sum, BLOCK: tl.constexpr,
                  ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at = tl.load(addresses + tensor).to(tl.pointer_type(tl.float32))  # written, never read
    if ALIGNED:
        w_at = tl.multiple_of(w_at, 16)
    anchor_at, anchor = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, m = load_block(addresses, 2 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    _, d = load_block(addresses, 3 * count + tensor, offsets, inside, tl.float32, ALIGNED)
    d = tl.where(inside, d, 1.0)  # past the tensor's end: no 0 / 0
    anchor = anchor - m / d * lr_sum
    tl.store(anchor_at + offsets, anchor, mask=inside)
    tl.store(w_at + offsets, anchor, mask=inside)


@kernel_op("slamb_optim::zero_one_sync_error", mutates_args=("momenta", "errors"))
def sync_error(params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], anchors: list[Tensor],
               denoms: list[Tensor], errors: list[Tensor], beta1: float, lr: float, weight_decay: float) -> None:
    """`m = lerp(m, g, 1 - beta1)` and `error += (w - w_a) d - lr m - lr weight_decay w d` for every tensor of a
    param group (fp32, contiguous)."""
    launch = multi_tensor_launch(params, grads, momenta, anchors, denoms, errors)
    if launch.programs:
        _sync_error[(launch.programs,)](*launch.head, 1.0 - beta1, lr, -lr * weight_decay,
                                        HAS_DECAY=weight_decay != 0, LERP_FROM_END=1.0 - beta1 >= 0.5,
                                        BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)


@sync_error.register_fake
def _(params, grads, momenta, anchors, denoms, errors, beta1, lr, weight_decay):
    return None


@kernel_op("slamb_optim::zero_one_sync_weights", mutates_args=("params", "anchors"))
def sync_weights(params: list[Tensor], anchors: list[Tensor], momenta: list[Tensor], denoms: list[Tensor],
                 lr_sum: float) -> None:
    """`w = w_a = w_a - lr_sum m / d` for every tensor of a param group (fp32, contiguous)."""
    launch = multi_tensor_launch(params, anchors, momenta, denoms)
    if launch.programs:
        _sync_weights[(launch.programs,)](*launch.head, lr_sum, BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)


@sync_weights.register_fake
def _(params, anchors, momenta, denoms, lr_sum):
    return None
