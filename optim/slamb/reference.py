"""SLAMB one tensor at a time, every rank in one process: the readable form of `SLAMB.step`, for tests and readers.

Plain tensors and boolean masks: rank i's copy w_i of a parameter, its local moments m_i and v_i, and the staleness
j of each coordinate (the same on every rank), whose freshness is r = beta3^j. Every switch of `SLAMB` that changes
the arithmetic is here; those that only choose or package the masks (mask, compress_ratio, min_compress_numel,
seed, bucket_mb) are not, since the masks S_t come in as arguments (`SLAMB.sync_masks` gives the fast path's).
The arithmetic runs in the tensors' dtype, so a float64 run measures the fast path's fp32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from optim._math import bias_corrections
from optim.comm import WIRE_DTYPES
from optim.slamb._layout import FRESHNESS_DTYPES


@dataclass
class ParamState:
    """One parameter tensor on every rank."""

    weights: list[Tensor]  # w_i, rank by rank
    exp_avgs: list[Tensor]  # m_i
    exp_avg_sqs: list[Tensor]  # v_i (never communicated)
    staleness: Tensor  # j: steps since the coordinate was last synced, 0 before step 1
    weight_decay: float

    @classmethod
    def replicated(cls, weight: Tensor, world_size: int, weight_decay: float) -> ParamState:
        """The state before step 1: the same weights on every rank, zero moments, everything fresh."""
        return cls([weight.clone() for _ in range(world_size)],
                   [torch.zeros_like(weight) for _ in range(world_size)],
                   [torch.zeros_like(weight) for _ in range(world_size)],
                   torch.zeros_like(weight), weight_decay)


def step(params: Sequence[ParamState], grads: Sequence[Sequence[Tensor]], masks: Sequence[Tensor], t: int, *,
         lr: float, betas: Sequence[float], eps: float, beta3: float, trust_ratio_bounds: Sequence[float],
         rescale: str, bias_correction_form: str, wd_in_trust_ratio: bool, stale_ratio_fallback: float,
         clamp_1d: bool, always_adapt: bool, comm_dtype: str, freshness_dtype: str, sync_interval: int,
         sync_offset: int, **_mask_options: object) -> None:
    """Step `t` (from 1) of every parameter on every rank: `grads[p][i]` is rank i's gradient of parameter p,
    `masks[p]` its S_t. Keyword arguments are `SLAMB`'s (all of them may be passed)."""
    world_size, (beta1, beta2) = len(params[0].weights), betas
    for param, param_grads, mask in zip(params, grads, masks, strict=True):
        # Local moments: m_i <- beta1 m_i + (1 - beta1) g_i, v_i <- beta2 v_i + (1 - beta2) g_i^2
        for m, v, g in zip(param.exp_avgs, param.exp_avg_sqs, param_grads, strict=True):
            m.lerp_(g, 1.0 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if world_size > 1:  # m_i[S_t] <- (1/N) sum_j m_j[S_t], the step's only message
            mean = _average([m[mask] for m in param.exp_avgs], WIRE_DTYPES[comm_dtype])
            for m in param.exp_avgs:
                m[mask] = mean
        # Freshness r = beta3^j, 1 where synced now; stored in `freshness_dtype` (one rounding)
        param.staleness.add_(1).masked_fill_(mask, 0)
        r = (beta3 ** param.staleness).to(FRESHNESS_DTYPES[freshness_dtype]).to(param.staleness.dtype)
        # Each rank's LAMB step, its trust ratio split between S_t (fresh) and the rest (stale)
        bc1, bc2 = bias_corrections(t, beta1, beta2, enabled=bias_correction_form != "none")
        lr_fresh, lr_stale = lr, lr / math.sqrt(world_size)
        c_min, c_max = trust_ratio_bounds
        adapt = always_adapt or param.weight_decay != 0  # False: NVLAMB's Adam step for no-decay tensors
        clamp = adapt and (clamp_1d or mask.dim() > 1)
        for w, m, v in zip(param.weights, param.exp_avgs, param.exp_avg_sqs, strict=True):
            if bias_correction_form == "full":  # LAMB's and the naive Slamb's: m_hat / (sqrt(v_hat) + eps)
                u = (m / bc1) / ((v / bc2).sqrt() + eps)
            else:  # Slamb_V2's: one scalar, eps not rescaled ("none": the scalar is 1)
                u = math.sqrt(bc2) / bc1 * m / (v.sqrt() + eps)
            decay = param.weight_decay * w
            normed = u + decay if wd_in_trust_ratio else u  # what the trust-ratio norms see
            if adapt:
                phi_fresh = _ratio(w[mask], normed[mask], 1.0)
                phi_stale = _ratio(w[~mask], normed[~mask], stale_ratio_fallback)
            else:
                phi_fresh = phi_stale = torch.tensor(1.0, dtype=w.dtype)
            if rescale == "sum_of_products":  # Slamb_V2: lr phi_F r + lr / sqrt(N) phi_U (1 - r)
                if clamp:
                    phi_fresh, phi_stale = phi_fresh.clamp(c_min, c_max), phi_stale.clamp(0.0, c_max)
                coef = lr_fresh * phi_fresh * r + lr_stale * phi_stale * (1 - r)
            else:  # the naive Slamb: clamp(r phi_F + (1 - r) phi_U) (r lr + (1 - r) lr / sqrt(N))
                phi = r * phi_fresh + (1 - r) * phi_stale
                coef = (phi.clamp(c_min, c_max) if clamp else phi) * (r * lr_fresh + (1 - r) * lr_stale)
            w.sub_(coef * (u + decay))
    if world_size > 1 and (t - sync_offset) % sync_interval == 0:  # dense parameter average (m, v, j are kept)
        for param in params:
            mean = _average(param.weights, torch.float32)
            for w in param.weights:
                w.copy_(mean)


def _ratio(weight: Tensor, update: Tensor, fallback: float) -> Tensor:
    """||w|| / ||u||, or `fallback` when either norm is 0 (an empty selection included)."""
    w, u = weight.norm(), update.norm()
    return w / u if w > 0 and u > 0 else torch.tensor(fallback, dtype=w.dtype)


def _average(tensors: Sequence[Tensor], wire: torch.dtype) -> Tensor:
    """The mean over ranks as the all-reduce forms it: a sum in fp32 divided by N, or in a 16-bit wire dtype each
    share divided by N first (so the sum stays in range) and the sum rounded in that dtype."""
    n = len(tensors)
    if wire == torch.float32:
        return sum(tensors[1:], tensors[0].clone()) / n
    shares = [(x / n).to(wire) for x in tensors]
    return sum(shares[1:], shares[0].clone()).to(tensors[0].dtype)
