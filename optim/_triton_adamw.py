"""AdamW's step in one Triton kernel per chunk of tensors: w, g, m and v read, w, m and v written, once each.

torch's fused AdamW kernel moves the same bytes, but on one H100 it took 1.30x the time a copy of those bytes takes,
where the multi-tensor kernels of `optim._triton` (a program per block, tensors reached through a table of addresses)
run SLAMB's and LAMB's passes of the same shape at the copy's bandwidth. The math and its order are those of torch's
fused kernel (`ADAM_MODE::ADAMW`): the weights decayed, the moments moved, the step divided by the bias corrections of
each tensor's own step count, which stays on the device (a 0-d float32 tensor per parameter, as torch keeps it for its
fused kernel), so the state is torch's and a checkpoint resumes on either path. The bias corrections are formed per
program in float64 from that count and log(beta). This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import DTYPES, address_table, block_of, kernel_op, load_block, multi_tensor_launch


@triton.jit
def _adamw(addresses, count, tensor_of_block, first_element, numels, steps, lr, beta1, beta2, log_beta1, log_beta2,
           eps, weight_decay, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
           ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    _, g = load_block(addresses, count + tensor, offsets, inside, G_DTYPE, ALIGNED)
    m_at, m = load_block(addresses, 2 * count + tensor, offsets, inside, W_DTYPE, ALIGNED)
    v_at, v = load_block(addresses, 3 * count + tensor, offsets, inside, W_DTYPE, ALIGNED)
    step = tl.load(tl.load(steps + tensor).to(tl.pointer_type(tl.float32))).to(tl.float64)
    correction1 = 1.0 - tl.exp(step * log_beta1)  # 1 - beta^t in float64: early on it cancels most of its digits
    correction2 = 1.0 - tl.exp(step * log_beta2)
    step_size = (lr / correction1).to(tl.float32)
    root_correction2 = tl.sqrt(correction2).to(tl.float32)
    w = w - lr * weight_decay * w
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - step_size * m / (tl.sqrt(v) / root_correction2 + eps)
    tl.store(w_at + offsets, w.to(W_DTYPE), mask=inside)
    tl.store(m_at + offsets, m.to(W_DTYPE), mask=inside)
    tl.store(v_at + offsets, v.to(W_DTYPE), mask=inside)


@kernel_op("slamb_optim::adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_step(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               steps: list[Tensor], lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of the tensors of `params` (one device and dtype, dense), each at its count in `steps` (0-d
    float32 tensors on the device, already counting this step)."""
    launch = multi_tensor_launch(params, grads, exp_avgs, exp_avg_sqs)
    if launch.programs:
        _adamw[(launch.programs,)](
            *launch.head, address_table(params[0].device, steps)[0], lr, beta1, beta2, math.log(beta1),
            math.log(beta2), eps, weight_decay,
            W_DTYPE=DTYPES[params[0].dtype], G_DTYPE=DTYPES[grads[0].dtype], BLOCK=_triton.BLOCK,
            ALIGNED=launch.aligned)


@adamw_step.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay):
    return None


def triton_adamw_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                  steps: list[Tensor], *, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> None:
    """Count the step of every tensor (one multi-tensor add on the device), then step them in the kernel."""
    torch._foreach_add_(steps, 1)
    adamw_step(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay)
