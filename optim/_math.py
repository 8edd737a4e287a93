"""Math shared by the LAMB family: global gradient norm, Adam moments with bias correction, trust ratio.

LAMB, SLAMB and 1-bit LAMB differ in what they communicate and when, not in these formulas, so each
formula lives here once, in a single-tensor form (the readable reference) and, where a hot path needs it,
a foreach form over a list of tensors. Nothing here reads a tensor's value on the host: fallbacks are
`torch.where`, so a step stays free of device-to-host syncs. The closure handling of `step` and the seeds of
the random masks live here too; the option checks the optimizers share are `optim.option_checks`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

# Elements per foreach call, by device type (absent: the whole list). On the CPU, whole-group temporaries
# (grads / divisor, denominators, updates) miss every cache and are page-faulted in afresh each step;
# 4M-element chunks made the BERT-base step 2.4x faster there. On a GPU the chunk bounds the temporaries: a
# whole group of BERT-XL (2.9B parameters) would need about 12 GB per full-size temporary, a chunk of 2^26
# elements 256 MB, while its dozen launches cost microseconds against the milliseconds of its passes (a
# tensor larger than the chunk, such as the 78M-element BERT-XL embedding, is a chunk of its own).
FOREACH_CHUNK_NUMEL = {"cpu": 1 << 22, "cuda": 1 << 26}


def global_grad_norm(grads: list[Tensor]) -> Tensor:
    """L2 norm over every element of every tensor in `grads`, in float32, as a 0-d tensor.

    The tensors may sit on several devices; the result is on the first one's device.
    """
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)  # fp16 squares would overflow
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def grad_prenorm_divisor(total_norm: Tensor, max_grad_norm: float) -> Tensor:
    """What NVLAMB divides every gradient by: `max(total_norm / max_grad_norm, 1)`.

    Dividing by this is clipping to the global norm `max_grad_norm`, which LAMB applies to the gradient
    before the moment updates (apex `FusedLAMB`, NVIDIA BERT); small norms pass through unchanged.
    """
    return torch.clamp(total_norm / max_grad_norm, min=1.0)


def bias_corrections(step: float, beta1: float, beta2: float, enabled: bool = True) -> tuple[float, float]:
    """Adam's `(1 - beta1**t, 1 - beta2**t)` for the 1-based step `t`; `(1, 1)` when disabled."""
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


def adam_moments_(exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, beta1: float, beta2: float) -> None:
    """In place: `m <- beta1 m + (1 - beta1) g` and `v <- beta2 v + (1 - beta2) g^2`."""
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def adam_direction(
    exp_avg: Tensor, exp_avg_sq: Tensor, bias_correction1: float | Tensor, root_correction2: float | Tensor,
    eps: float,
) -> Tensor:
    """Adam's update `m_hat / (sqrt(v_hat) + eps)`, `m_hat = m / bc1`, `v_hat = v / bc2` (a new tensor), from bc1 and
    `root_correction2 = sqrt(bc2)`.

    The corrections are numbers, or 0-d tensors in a compiled step, formed on the host: a number would be baked into
    the graph, and a correction formed inside a pass from the step count would be formed again for every few
    elements (inductor's CPU loop).
    """
    denom = (exp_avg_sq.sqrt() / root_correction2).add_(eps)
    return (exp_avg / bias_correction1).div_(denom)


def fused_add_adam_direction_(
    targets: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], *,
    scale: float, step: int, beta1: float, beta2: float, eps: float, bias_correction: bool = True,
) -> None:
    """In one pass of torch's fused Adam kernel: `adam_moments_` of `grads`, then `targets += scale * direction`
    with `direction = m_hat / (sqrt(v_hat) + eps)` at the 1-based step `step` (`adam_direction`'s formula).

    The kernel reads each element of the four lists once and writes targets and moments once: the moments and
    the direction cost one memory pass where separate foreach kernels take six. `targets` may be the parameters
    (`scale = -lr`: a plain Adam step) or a buffer that already holds other terms of an update. Every list is on
    one device (one with torch's fused kernels, or `meta`) and in one dtype. The direction rounds apart from
    `adam_direction`'s by a few units in the last place (the kernel orders its divisions otherwise); on the CPU
    the moments are bit for bit `adam_moments_`'s (a GPU's kernel may round them apart too).
    """
    # The kernel reads t from a tensor on the targets' device (a fill, not a host-to-device copy, so no sync);
    # t = inf makes both corrections exactly 1 (beta ** inf = 0 for beta in [0, 1)): bias correction off.
    t = torch.full((), float(step) if bias_correction else math.inf, dtype=torch.float32, device=targets[0].device)
    torch._fused_adam_(targets, grads, exp_avgs, exp_avg_sqs, [], [t] * len(targets), lr=-scale, beta1=beta1,
                       beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False)


def trust_ratio(
    weight_norm: Tensor, update_norm: Tensor, max_ratio: float | None = None, min_ratio: float | None = None
) -> Tensor:
    """LAMB's layer-wise ratio `||w|| / ||u||`, 1 when either norm is 0, optionally clamped.

    Works elementwise, so it takes one pair of 0-d norms or stacked norms of many tensors. The fallback
    keeps freshly zero-initialised weights (and zero updates) moving at the plain learning rate instead of
    stalling at ratio 0 or producing NaN. `max_ratio=1` is timm's `trust_clip` (LAMBC); DeepSpeed's LAMB
    and 1-bit LAMB clamp to `[min_coeff, max_coeff]`.
    """
    ratio = weight_norm / update_norm
    ratio = torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
    if max_ratio is not None or min_ratio is not None:
        ratio = torch.clamp(ratio, min=min_ratio, max=max_ratio)
    return ratio


def foreach_momentum_(exp_avgs: list[Tensor], grads: list[Tensor], beta1: float) -> None:
    """`m <- beta1 m + (1 - beta1) g` written as DeepSpeed's 1-bit optimizers write it (mul, then add).

    `adam_moments_` uses `lerp`, which rounds differently; the 1-bit family keeps DeepSpeed's form so
    that its trajectories can be compared with the reference's step by step.
    """
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)


def foreach_variance_(exp_avg_sqs: list[Tensor], grads: list[Tensor], beta2: float) -> None:
    """`v <- beta2 v + (1 - beta2) g^2` over lists of tensors."""
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)


def foreach_adam_update(
    params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], eps: float, weight_decay: float
) -> tuple[list[Tensor], list[Tensor]]:
    """`(updates, denoms)` with `denom = sqrt(v) + eps` and `update = m / denom + weight_decay * w` (new tensors).

    Adam without bias correction and with decoupled decay inside the LR product, the direction of 1-bit Adam,
    0/1 Adam and 1-bit LAMB (DeepSpeed); the caller scales and applies it.
    """
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, eps)
    updates = torch._foreach_div(exp_avgs, denoms)
    if weight_decay != 0:  # a product, then a sum, as DeepSpeed: `add_(alpha=)` may fuse them and round once
        torch._foreach_add_(updates, torch._foreach_mul(params, weight_decay))
    return updates, denoms


def clamped_trust_ratio(weight_norm: Tensor, update_norm: Tensor, max_ratio: float, min_ratio: float) -> Tensor:
    """DeepSpeed LAMB's coefficient: `||w|| / ||u||` clamped to `[min_ratio, max_ratio]`, and exactly 1 (not
    clamped) when either norm is 0. `trust_ratio` clamps after its fallback, so a zero weight would get
    `max_ratio`; 1-bit LAMB's frozen-coefficient average also skips a coefficient of exactly 1.

    The ratio is formed in the norms' dtype and clamped in float64 (DeepSpeed clamps a Python float).
    """
    ratio = (weight_norm / update_norm).double().clamp(min=min_ratio, max=max_ratio)
    return torch.where((weight_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What `step(closure)` returns: the closure's loss, evaluated with gradients enabled; None without one."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# ------------------------------------------------------------------------------------------ seeded masks
# Random subsets that every rank draws alike from a private generator seeded by (seed, step) (SLAMB's momentum
# masks, JointSpar's layer sampling), so that nothing reseeds the global RNG.


def mask_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): splitmix64 of both, so nearby seeds give unrelated masks."""
    x = ((seed & 0xFFFFFFFF) << 32 | (step & 0xFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1
