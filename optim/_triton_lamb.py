"""LAMB's update of trust-ratio tensors in three Triton kernels per chunk, however many tensors it holds.

torch has fused kernels for Adam and SGD but none for LAMB, whose trust ratio needs each tensor's norms before any
of its weights change. Its aten form is a fused Adam pass, foreach norms and a multiply-add by per-tensor 0-d
factors, which torch's multi-tensor kernels cannot take in one launch: 14 tensor-sized reads and writes, and a
kernel per tensor. These kernels reach every tensor of a chunk through a table of addresses, as apex's
`multi_tensor_apply` does, one program per block of `BLOCK` elements:

1. `lamb_moments`: reads g, m, v and w, writes m and v, and each block's sums of w^2 and u^2 (6 reads and writes);
2. `lamb_factors`: one program per tensor adds its blocks' sums in a fixed order and writes `-lr * ratio`. No
   atomic adds: replicas that step the same inputs stay bit-identical, as a checkpoint resumed does;
3. `lamb_apply`: reads w, m and v, forms u again and writes w (4).

Ten reads and writes, as `compiled=True` moves, in three launches. Each kernel is a torch custom op, so a dispatch
mode counts its tensors (`benchmarks.optim.step_cost`) and meta tensors pass through it. The kernels take CUDA
tensors, or host tensors under Triton's interpreter (`TRITON_INTERPRET=1`: slow, for tests). This module imports
triton: `optim.lamb` imports it only when a step takes this path, after checking that it can.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

BLOCK = 2048  # elements per program of the elementwise kernels
SUM_BLOCK = 1024  # block sums a program of `lamb_factors` adds per iteration
_ADDRESS_TABLES = 64  # address tables kept per process (one per chunk, more when gradients move)


# ------------------------------------------------------------------------------------------ tables
@functools.cache
def _blocks(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per block of `block` elements its tensor (int32) and first element (int64); per tensor its size (int64) and,
    as a prefix, its first block (int32, one entry more). Sizes never change: each chunk builds these once."""
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    first_block = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    blocks = int(first_block[-1])
    tensor_of_block = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts,
                                              output_size=blocks)
    first_element = (torch.arange(blocks, dtype=torch.int64) - first_block[:-1].repeat_interleave(counts)) * block
    host = (tensor_of_block, first_element, torch.tensor(numels, dtype=torch.int64), first_block.int())
    return tuple(_to_device(t, device) for t in host)  # type: ignore[return-value]


_addresses: dict[tuple[int, ...], Tensor] = {}


def _address_table(device: torch.device, *lists: list[Tensor]) -> Tensor:
    """The lists' addresses, list after list, as one int64 vector on `device`, reused while they stay put (a
    parameter and its state never move; a gradient may, when the trainer frees it between steps)."""
    key = tuple(t.data_ptr() for tensors in lists for t in tensors)
    table = _addresses.get(key)
    if table is None:
        if len(_addresses) >= _ADDRESS_TABLES:
            _addresses.clear()
        table = _addresses[key] = _to_device(torch.tensor(key, dtype=torch.int64), device)
    return table


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor copied to `device` without waiting for it (through pinned memory on a GPU)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ------------------------------------------------------------------------------------------ kernels
# Plain functions: `_kernel` builds each as a Triton JIT kernel for CUDA tensors and as an interpreted one for host
# tensors. The update u is the same expression in both elementwise kernels (Triton's interpreter cannot call a
# JIT-compiled helper).
def _moments(addresses, count, tensor_of_block, first_element, numels, partials, blocks, divisor,
             beta1, beta2, bias_correction1, root_correction2, eps, weight_decay,
             HAS_DIVISOR: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    tensor = tl.load(tensor_of_block + block)
    offsets = tl.load(first_element + block) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(numels + tensor)
    w_at = tl.load(addresses + tensor).to(tl.pointer_type(DTYPE))
    g_at = tl.load(addresses + count + tensor).to(tl.pointer_type(DTYPE))
    m_at = tl.load(addresses + 2 * count + tensor).to(tl.pointer_type(DTYPE))
    v_at = tl.load(addresses + 3 * count + tensor).to(tl.pointer_type(DTYPE))
    w = tl.load(w_at + offsets, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_at + offsets, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(m_at + offsets, mask=inside, other=0.0).to(tl.float32)
    v = tl.load(v_at + offsets, mask=inside, other=0.0).to(tl.float32)
    if HAS_DIVISOR:
        g = g / tl.load(divisor)
    m = m + (1.0 - beta1) * (g - m)  # a lerp, as `adam_moments_`
    v = v * beta2 + (1.0 - beta2) * g * g
    tl.store(m_at + offsets, m.to(DTYPE), mask=inside)
    tl.store(v_at + offsets, v.to(DTYPE), mask=inside)
    u = (m / bias_correction1) / (tl.sqrt(v) / root_correction2 + eps) + weight_decay * w  # 0 outside the tensor
    tl.store(partials + block, tl.sum(w * w, axis=0))
    tl.store(partials + blocks + block, tl.sum(u * u, axis=0))


def _factors(partials, blocks, first_block, out, lr, max_ratio, HAS_MAX: tl.constexpr, SUM_BLOCK: tl.constexpr):
    tensor = tl.program_id(0)
    first = tl.load(first_block + tensor)
    last = tl.load(first_block + tensor + 1)
    w_sum = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    u_sum = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(first, last, SUM_BLOCK):
        at = start + tl.arange(0, SUM_BLOCK)
        w_sum += tl.load(partials + at, mask=at < last, other=0.0)
        u_sum += tl.load(partials + blocks + at, mask=at < last, other=0.0)
    w_norm = tl.sqrt(tl.sum(w_sum, axis=0))
    u_norm = tl.sqrt(tl.sum(u_sum, axis=0))
    adapted = (w_norm > 0) & (u_norm > 0)
    ratio = tl.where(adapted, w_norm / tl.where(adapted, u_norm, 1.0), 1.0)  # `optim._math.trust_ratio`
    if HAS_MAX:
        ratio = tl.minimum(ratio, max_ratio)
    tl.store(out + tensor, -lr * ratio)


def _apply(addresses, count, tensor_of_block, first_element, numels, scale,
           bias_correction1, root_correction2, eps, weight_decay, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0)
    tensor = tl.load(tensor_of_block + block)
    offsets = tl.load(first_element + block) + tl.arange(0, BLOCK)
    inside = offsets < tl.load(numels + tensor)
    w_at = tl.load(addresses + tensor).to(tl.pointer_type(DTYPE))
    m_at = tl.load(addresses + count + tensor).to(tl.pointer_type(DTYPE))
    v_at = tl.load(addresses + 2 * count + tensor).to(tl.pointer_type(DTYPE))
    w = tl.load(w_at + offsets, mask=inside, other=0.0).to(tl.float32)
    m = tl.load(m_at + offsets, mask=inside, other=0.0).to(tl.float32)
    v = tl.load(v_at + offsets, mask=inside, other=0.0).to(tl.float32)
    u = (m / bias_correction1) / (tl.sqrt(v) / root_correction2 + eps) + weight_decay * w
    tl.store(w_at + offsets, (w + tl.load(scale + tensor) * u).to(DTYPE), mask=inside)


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.cache
def _kernel(fn: Callable[..., None], device_type: str) -> Any:
    """`fn` as a Triton kernel: compiled for CUDA tensors, interpreted for host tensors (`TRITON_INTERPRET=1`)."""
    return JITFunction(fn) if device_type == "cuda" else InterpretedFunction(fn)


# ------------------------------------------------------------------------------------------ ops
@torch.library.custom_op("slamb_optim::lamb_moments", mutates_args=("exp_avgs", "exp_avg_sqs"))
def lamb_moments(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 divisor: Tensor | None, beta1: float, beta2: float, bias_correction1: float, bias_correction2: float,
                 eps: float, weight_decay: float) -> Tensor:
    """m and v moved by the gradients (divided by `divisor` when given), and per block of `BLOCK` elements the sums
    of w^2 and of the update's u^2, as a (2, blocks) float32 tensor."""
    device = params[0].device
    tensor_of_block, first_element, numels, _ = _blocks(tuple(p.numel() for p in params), BLOCK, device)
    partials = torch.empty((2, tensor_of_block.numel()), dtype=torch.float32, device=device)
    if tensor_of_block.numel():
        _kernel(_moments, device.type)[(tensor_of_block.numel(),)](
            _address_table(device, params, grads, exp_avgs, exp_avg_sqs), len(params), tensor_of_block,
            first_element, numels, partials, tensor_of_block.numel(), divisor if divisor is not None else partials,
            beta1, beta2, bias_correction1, bias_correction2 ** 0.5, eps, weight_decay,
            HAS_DIVISOR=divisor is not None, DTYPE=_DTYPES[params[0].dtype], BLOCK=BLOCK)
    return partials


@lamb_moments.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, divisor, beta1, beta2, bias_correction1, bias_correction2, eps,
      weight_decay):
    blocks = sum(-(-p.numel() // BLOCK) for p in params)
    return params[0].new_empty((2, blocks), dtype=torch.float32)


@torch.library.custom_op("slamb_optim::lamb_factors", mutates_args=())
def lamb_factors(partials: Tensor, numels: list[int], lr: float, max_ratio: float | None) -> Tensor:
    """Per tensor `-lr * ratio`, the ratio `||w|| / ||u||` from its blocks' sums (1 where a norm is 0, at most
    `max_ratio` when given)."""
    device = partials.device
    out = torch.empty(len(numels), dtype=torch.float32, device=device)
    if numels:
        first_block = _blocks(tuple(numels), BLOCK, device)[3]
        _kernel(_factors, device.type)[(len(numels),)](
            partials, partials.size(1), first_block, out, lr, max_ratio if max_ratio is not None else 0.0,
            HAS_MAX=max_ratio is not None, SUM_BLOCK=SUM_BLOCK)
    return out


@lamb_factors.register_fake
def _(partials, numels, lr, max_ratio):
    return partials.new_empty(len(numels))


@torch.library.custom_op("slamb_optim::lamb_apply", mutates_args=("params",))
def lamb_apply(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], scales: Tensor,
               bias_correction1: float, bias_correction2: float, eps: float, weight_decay: float) -> None:
    """`w += scale * u` per tensor, the update u formed again from w and the moments `lamb_moments` wrote."""
    device = params[0].device
    tensor_of_block, first_element, numels, _ = _blocks(tuple(p.numel() for p in params), BLOCK, device)
    if tensor_of_block.numel():
        _kernel(_apply, device.type)[(tensor_of_block.numel(),)](
            _address_table(device, params, exp_avgs, exp_avg_sqs), len(params), tensor_of_block, first_element,
            numels, scales, bias_correction1, bias_correction2 ** 0.5, eps, weight_decay,
            DTYPE=_DTYPES[params[0].dtype], BLOCK=BLOCK)


@lamb_apply.register_fake
def _(params, exp_avgs, exp_avg_sqs, scales, bias_correction1, bias_correction2, eps, weight_decay):
    return None


def triton_lamb_update_(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                        *, grad_divisor: Tensor | None, lr: float, corrections: tuple[float, float], beta1: float,
                        beta2: float, eps: float, weight_decay: float, max_ratio: float | None) -> None:
    """LAMB's update of one chunk of trust-ratio tensors (one device and dtype, contiguous) in the three kernels."""
    bias_correction1, bias_correction2 = corrections
    partials = lamb_moments(params, grads, exp_avgs, exp_avg_sqs, grad_divisor, beta1, beta2, bias_correction1,
                            bias_correction2, eps, weight_decay)
    scales = lamb_factors(partials, [p.numel() for p in params], lr, max_ratio)
    lamb_apply(params, exp_avgs, exp_avg_sqs, scales, bias_correction1, bias_correction2, eps, weight_decay)
