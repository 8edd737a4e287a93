"""Math shared by the LAMB family: global gradient norm, Adam moments with bias correction, trust ratio.

LAMB, SLAMB and 1-bit LAMB differ in what they communicate and when, not in these formulas, so each
formula lives here once, in a single-tensor form (the readable reference) and, where a hot path needs it,
a foreach form over a list of tensors. Nothing here reads a tensor's value on the host: fallbacks are
`torch.where`, so a step stays free of device-to-host syncs. The value checks every optimizer's options share
(the Adam four, switches) and the closure handling of `step` live here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from conf.checks import check_non_negative, require

# Elements per foreach call, by device type (absent: the whole list). On the CPU, whole-group temporaries
# (grads / divisor, denominators, updates) miss every cache and are page-faulted in afresh each step;
# 4M-element chunks made the BERT-base step 2.4x faster there. On a GPU the chunk bounds the temporaries: a
# whole group of BERT-XL (2.9B parameters) would need about 12 GB per full-size temporary, a chunk of 2^26
# elements 256 MB, while its dozen launches cost microseconds against the milliseconds of its passes (a
# tensor larger than the chunk, such as the 78M-element BERT-XL embedding, is a chunk of its own).
FOREACH_CHUNK_NUMEL = {"cpu": 1 << 22, "cuda": 1 << 26}


def foreach_chunks(tensors: Sequence[Tensor], max_numel: int | None = None) -> list[slice]:
    """Consecutive slices of `tensors` holding at most `max_numel` elements each (a larger tensor: alone);
    by default the chunk size of the tensors' device type (`FOREACH_CHUNK_NUMEL`)."""
    if max_numel is None and tensors:
        max_numel = FOREACH_CHUNK_NUMEL.get(tensors[0].device.type)
    if max_numel is None:
        return [slice(0, len(tensors))]
    chunks, start, numel = [], 0, 0
    for i, t in enumerate(tensors):
        if i > start and numel + t.numel() > max_numel:
            chunks.append(slice(start, i))
            start, numel = i, 0
        numel += t.numel()
    chunks.append(slice(start, len(tensors)))
    return chunks


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


def foreach_adam_moments_(
    exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], grads: list[Tensor], beta1: float, beta2: float
) -> None:
    """`adam_moments_` over lists of tensors with foreach kernels."""
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)


def adam_direction(
    exp_avg: Tensor, exp_avg_sq: Tensor, bias_correction1: float, bias_correction2: float, eps: float
) -> Tensor:
    """Adam's update `m_hat / (sqrt(v_hat) + eps)`, `m_hat = m / bc1`, `v_hat = v / bc2` (a new tensor)."""
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    return (exp_avg / bias_correction1).div_(denom)


def foreach_adam_denom(
    exp_avg_sqs: list[Tensor], bias_corrections1: list[float], bias_corrections2: list[float], eps: float
) -> tuple[list[Tensor], list[float]]:
    """Adam's denominators with the bias corrections folded into scalars, saving two passes over the tensors.

    Returns `(denoms, scales)` with `denom = sqrt(v) + eps * sqrt(bc2)` and `scale = sqrt(bc2) / bc1`, so
    that `m_hat / (sqrt(v_hat) + eps) == scale * m / denom`. The caller applies the scale as the scalar of
    the `addcdiv` that forms `m / denom` anyway.
    """
    roots = [math.sqrt(bc2) for bc2 in bias_corrections2]
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, [eps * root for root in roots])
    return denoms, [root / bc1 for root, bc1 in zip(roots, bias_corrections1, strict=True)]


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

    `foreach_adam_moments_` uses `lerp`, which rounds differently; the 1-bit family keeps DeepSpeed's form so
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


def check_adam_hyperparameters(options: Mapping[str, Any]) -> None:
    """The Adam family's `lr`, `betas`, `eps`, `weight_decay`: an `InvalidOption` naming the first bad one.

    The check of `adamw` and the first part of every other optimizer's check (constructors and config alike).
    """
    check_non_negative("lr", options["lr"])
    betas = options["betas"]
    require(isinstance(betas, Sequence) and len(betas) == 2 and all(0.0 <= beta < 1.0 for beta in betas),
            "betas", betas, "must be two values in [0, 1)")
    check_non_negative("eps", options["eps"])
    check_non_negative("weight_decay", options["weight_decay"])


def check_flags(options: Mapping[str, Any], *keys: str) -> None:
    """Options that are switches must be true or false (a string or a pair is some other optimizer's option)."""
    for key in keys:
        require(isinstance(options[key], bool), key, options[key], "must be true or false")


# ------------------------------------------------------------------------------------------ seeded masks
# Random coordinate subsets that every rank draws alike from a private generator seeded by (seed, step): SLAMB's
# momentum masks. Each sampler returns positions of one fixed length, known on the host from the tensor's size
# alone, so that a step can compact, all-reduce and scatter them without reading anything from the device.


def mask_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): splitmix64 of both, so nearby seeds give unrelated masks."""
    x = ((seed & 0xFFFFFFFF) << 32 | (step & 0xFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def stratified_count(n: int, k: float) -> int:
    """How many of `n` rows `stratified_rows` selects: round(k n), at least 1 and at most n."""
    return min(n, max(1, round(k * n)))


def stratified_plan(tensors: Sequence[tuple[int, int, int, int]], device: torch.device) -> dict[str, Any]:
    """The constants of `stratified_rows`, built once for the tensors of one draw.

    `tensors` holds per tensor `(n, count, first, offset)`: `count` of its `n` rows are picked by the uniforms at
    [first, first + count) and rotated by the one at first + count; its rows are shifted by `offset` (its first
    row in a shared row space). Rows come out tensor by tensor, in the order of `tensors`. Everything but the
    rotation is fixed, so it is kept per pick (20 bytes, about 0.13 byte per coordinate for rows of 16 at
    k = 0.1): a step then costs a few passes over the picks. Written in place, tensor by tensor (no temporaries,
    no host read).
    """
    counts = [t[1] for t in tensors]
    picks = sum(counts)
    at, base, end, n_rows = (torch.empty(picks, dtype=torch.int32, device=device) for _ in range(4))
    length = torch.empty(picks, dtype=torch.float32, device=device)
    for (n, count, first, offset), a in zip(tensors, _starts(counts), strict=True):
        q, long = divmod(n, count)  # the first `long` strata have q + 1 rows, the others q
        split, b = a + long, a + count
        torch.arange(first, first + count, out=at[a:b])
        # stratum i starts at i (q + 1) among the long ones, at i q + long after them
        torch.arange(offset, offset + long * (q + 1), q + 1, out=base[a:split])
        torch.arange(offset + long * (q + 1), offset + n, q, out=base[split:b])
        length[a:split].fill_(q + 1)
        length[split:b].fill_(q)
        end[a:b].fill_(offset + n)
        n_rows[a:b].fill_(n)

    def column(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    return {"at": at, "length": length, "base": base, "end": end, "n": n_rows, "picks": picks,
            "rotation_at": column([t[2] + t[1] for t in tensors], torch.int64),
            "rotation_scale": column([t[0] for t in tensors], torch.float32),
            "count": column(counts, torch.int64)}


def stratified_rows(uniforms: Tensor, plan: dict[str, Any]) -> Tensor:
    """Exactly `count` distinct rows per tensor of `plan`: one uniformly in each of `count` strata, randomly rotated.

    The strata tile [0, n) with lengths q = n // count or q + 1 (the first n % count are the longer ones), and the
    whole pattern is rotated by a uniform offset, so that every row is selected with probability exactly count / n
    (unequal strata would otherwise favour the short ones). Masks of different steps use independent uniforms, so
    a coordinate's selections are independent across steps, as with per-coordinate Bernoulli draws; within a step
    the count is fixed (no host read to size the all-reduce) and selections are spread evenly. A fixed number of
    vectorised ops for all the tensors, integer arithmetic but for the two products with a uniform.
    """
    # the float32 products are those of the scalar form (lengths and n exact below 2^24); the cast floors them
    rotation = uniforms.index_select(0, plan["rotation_at"]).mul_(plan["rotation_scale"]).to(torch.int64)
    rows = uniforms.index_select(0, plan["at"]).mul_(plan["length"]).to(torch.int64).add_(plan["base"])
    rows.add_(torch.repeat_interleave(rotation, plan["count"], output_size=plan["picks"]))
    return torch.where(rows >= plan["end"], rows - plan["n"], rows)  # the rotation wraps within its tensor


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive runs of `sizes` elements starts."""
    starts, position = [], 0
    for size in sizes:
        starts.append(position)
        position += size
    return starts


def bernoulli_capacity(n: int, k: float, sigmas: float = 8.0) -> int:
    """A bound on Binomial(n, k) exceeded with probability below 1e-15 (mean + 8 sigma + 16), at most n."""
    mean = n * k
    return min(n, math.ceil(mean + sigmas * math.sqrt(mean * (1.0 - k)) + 16))


def bernoulli_plan(tensors: Sequence[tuple[int, int, int]], device: torch.device) -> dict[str, Any]:
    """The per-tensor constants of `bernoulli_rows`, built once: `tensors` holds per tensor `(n, capacity,
    offset)`, drawn from consecutive runs of `capacity` uniforms, its positions shifted by `offset`."""
    capacities = [t[1] for t in tensors]
    first = torch.tensor(_starts(capacities), dtype=torch.int64)
    n, offset = (torch.tensor([t[i] for t in tensors], dtype=torch.int64) for i in (0, 2))
    count = torch.tensor(capacities, dtype=torch.int64)
    plan = {"first": first, "shift": first - offset, "end": n + offset, "count": count}
    return {key: value.to(device) for key, value in plan.items()} | {"picks": sum(capacities)}


def bernoulli_rows(uniforms: Tensor, k: float, plan: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """`(positions, valid)`: each of [0, n) selected independently with probability k, padded to a fixed length,
    for every tensor of `plan` at once.

    The gaps between successive Bernoulli(k) successes are i.i.d. Geometric(k); drawing one gap per uniform
    (inverse CDF: floor(log(1 - U) / log(1 - k)) + 1) costs about k n random numbers instead of n. Their running
    sum within each tensor (one cumsum of all, minus its value before the tensor's first gap: integers, exact)
    gives the sorted positions. The capacity fixes the length (`bernoulli_capacity`): positions past n are
    padding, replaced by a copy of the tensor's first position (a duplicate carries the same value through a
    gather, all-reduce and scatter, so it changes nothing) and marked invalid (0) in `valid`, which keeps them
    out of norms. Two events change the mask, both with probability below 1e-15 per tensor and step at the
    default capacity, and both decided on the device: more successes than the capacity (the last ones are not
    selected this step) and no success at all (position n - 1 is selected).
    """
    total, first = plan["picks"], plan["first"]

    def spread(per_tensor: Tensor) -> Tensor:  # one value per tensor -> one per position
        return torch.repeat_interleave(per_tensor, plan["count"], output_size=total)

    rows = torch.arange(total, device=uniforms.device)  # position + offset = rows - shift within a tensor
    if k >= 1.0:
        return rows.sub_(spread(plan["shift"])), torch.ones(total, device=uniforms.device)
    # 1 - U lies in (0, 1], so its log is finite; log is vectorised where log1p is not (10x on the CPU).
    gaps = uniforms.neg().add_(1.0).log_().div_(math.log1p(-k)).to(torch.int64)
    sums = torch.zeros(total + 1, dtype=torch.int64, device=gaps.device)
    torch.cumsum(gaps, 0, out=sums[1:])
    # the gaps' running sum within the tensor, plus the position's index in it, plus the offset (exact integers)
    rows.add_(sums[1:]).sub_(spread(sums.index_select(0, first).add_(plan["shift"])))
    valid = (rows < spread(plan["end"])).index_fill_(0, first, True)
    first_rows = torch.minimum(rows.index_select(0, first), plan["end"] - 1)
    return torch.where(valid, rows, spread(first_rows)), valid.to(torch.float32)
