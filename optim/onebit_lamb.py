"""1-bit LAMB (Li et al. 2021): LAMB warm-up, then 1-bit compressed momentum with frozen LAMB coefficients."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from conf.checks import check_non_negative, check_positive, require
from optim._math import (
    clamped_trust_ratio,
    foreach_adam_update,
    foreach_chunks,
    foreach_momentum_,
    foreach_variance_,
)
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import Comm
from optim.memory import onebit_family_bytes
from optim.onebit_adam import (
    DIFFERENCES_FROM_DEEPSPEED,
    ONEBIT_RESTART_REFUSAL,
    OneBitFamily,
    check_onebit_family_options,
)


def check_onebit_lamb_options(options: dict[str, Any]) -> None:
    """1-bit LAMB's value checks, run by its constructor and, through the registry, on the config."""
    o = options
    check_onebit_family_options(o, bucketings=("flat_scaled", "per_group", "per_tensor"))
    for low, high in (("min_coeff", "max_coeff"), ("factor_min", "factor_max")):
        check_positive(low, o[low])
        require(o[low] <= o[high], high, o[high], f"must be >= {low}={o[low]} (need 0 < {low} <= {high})")
    check_non_negative("factor_threshold", o["factor_threshold"])
    require(0.0 <= o["coeff_beta"] < 1.0, "coeff_beta", o["coeff_beta"], "must be in [0, 1)")


# 1-bit LAMB's one work buffer, what replaces DeepSpeed's clone of every momentum: its compressed step runs foreach
# ops over chunks of tensors of at most this many elements, each chunk with a view of the buffer as its temporary
# (a larger tensor is cut into 1-D pieces). It holds an eighth of the parameters, at most 64 MiB of fp32: a bounded
# buffer, and a step of at most about 16 chunks plus one per 2^24 elements, however many tensors there are.
# Smaller, cache-sized chunks do not pay on a CPU (BERT-base, one thread: 2^20 elements per chunk no faster than
# 2^24 or whole lists) and only multiply the launches on a GPU.
_SCRATCH_NUMEL, _SCRATCH_FRACTION = 1 << 24, 8


# Aligned chunks of lists of tensors, each with a list of temporaries shaped like them (`OneBitLAMB._chunks`).
Chunks = Callable[..., Iterable[tuple[list[Tensor], ...]]]


class OneBitLAMB(OneBitFamily):
    r"""1-bit LAMB (Li, Awan, Tang, Rajbhandari, He; arXiv 2104.06069), with DeepSpeed 0.19.6's semantics.

    With :math:`t` counting steps including the no-op init step, :math:`\bar g` the exact mean gradient:

    - Warm-up, :math:`t \le` ``freeze_step``: LAMB without bias correction on :math:`\bar g`,
      :math:`u = m/(\sqrt v+\epsilon) + \lambda w`, :math:`c = \lVert w\rVert/\lVert u\rVert` clamped to
      [``min_coeff``, ``max_coeff``] (1 if a norm is 0), :math:`w \leftarrow w - \eta c u`; the frozen
      coefficient :math:`c_{frz} \leftarrow \beta_c c_{frz} + (1-\beta_c) c` from 0, no bias correction,
      skipped when :math:`c = 1`. At the last warm-up step :math:`v_{fresh} \leftarrow v`.
    - Compression (:math:`v` frozen): at its first step every tensor gets ``scaling_coeff`` = mean RMS of
      all momenta / its own momentum's RMS. Then :math:`m \leftarrow C\big((\beta_1 m + (1-\beta_1)
      g_{local}) s_p\big)/s_p` with one fused compressed call over all momenta (padded tail kept),
      masked; :math:`\tilde g = (m - \beta_1 m_{old})/(1-\beta_1)` refreshes :math:`v_{fresh}`;
      ``factor`` = max over elements of :math:`(\sqrt v+\epsilon)/(\sqrt{v_{fresh}}+\epsilon)`, blended
      with :math:`\rho = \min(1, \lVert m/(\sqrt v+\epsilon)\rVert/\lVert u\rVert)` when :math:`\lambda>0`,
      clamped to [``factor_min``, ``factor_max``] and to ``factor_threshold`` around the last factor;
      :math:`w \leftarrow w - \eta\, c_{frz}\,\text{factor}\; u`.

    The coefficient chain is computed in float64 on the device (DeepSpeed does it in Python floats), so a
    step has no device-to-host syncs. ``lamb_coeffs()`` returns the last step's coefficients (a copy, #8227).

    Args:
        params: parameters or param groups (``exp_avg_mask`` as in DeepSpeed).
        lr, betas, eps, weight_decay: as in LAMB; decay is added to the update inside the LR product.
        freeze_step: last step (counting the init step) of the warm-up; keep it >> 1/(1 - coeff_beta).
        max_coeff, min_coeff: clamp of the warm-up LAMB coefficient.
        coeff_beta: EMA factor of the frozen coefficient.
        factor_max, factor_min, factor_threshold: clamps of the compression-stage factor.
        bucketing: ``flat_scaled`` (DeepSpeed: one call over all momenta, with scaling coefficients),
            ``per_group`` or ``per_tensor``.
        init_noop_step, mask_zero_variance, dense_comm_dtype, comm: as in `OneBitAdam`.
    """

    __doc__ = (__doc__ or "") + DIFFERENCES_FROM_DEEPSPEED + """
    - 1-bit LAMB: a momentum whose RMS is 0 at the first compression step gets scaling coefficient 1
      (DeepSpeed divides by 0).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, bucketing: str = "flat_scaled", init_noop_step: bool = True,
                 mask_zero_variance: bool = True, dense_comm_dtype: str = "fp32", comm: Comm | None = None) -> None:
        run_check(type(self).__name__, check_onebit_lamb_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step, max_coeff=max_coeff,
            min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
            factor_threshold=factor_threshold, bucketing=bucketing, init_noop_step=init_noop_step,
            mask_zero_variance=mask_zero_variance, dense_comm_dtype=dense_comm_dtype,
        ))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        super().__init__(params, defaults, comm, bucketing, init_noop_step, mask_zero_variance, dense_comm_dtype,
                         keep_tail=bucketing == "flat_scaled", flat_keys=("exp_avg_sq", "exp_avg_sq_fresh"))
        self.scaled = bucketing == "flat_scaled"
        self._lamb_coeffs: list[Tensor] = []
        self._scratch: Tensor | None = None  # the bounded work buffer (see `_chunks`)
        self._scratch_cache: dict[tuple[torch.Size, ...], list[Tensor]] = {}
        numel = sum(p.numel() for p in self._params())
        self._chunk_numel = min(_SCRATCH_NUMEL, -(-numel // _SCRATCH_FRACTION))

    def _init_state(self, state: dict[str, Any], p: Tensor) -> None:
        state["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float64, device=p.device)
        state["last_factor"] = torch.ones((), dtype=torch.float64, device=p.device)

    def compressing(self, t: int) -> bool:
        return t > max(self.freeze_step, self.first_real_step)

    def lamb_coeffs(self) -> list[float]:
        """The coefficient each tensor's update was scaled by in the last step (a copy; reads the device)."""
        return [float(c) for c in self._lamb_coeffs]

    def _step(self, t: int) -> None:
        if self.compressing(t):
            self._compressed_step()
        else:
            self._warmup_step(last=t == max(self.freeze_step, self.first_real_step))

    def _warmup_step(self, last: bool) -> None:
        params, grads = self._params(), self._grads()
        self._average(grads)
        self._lamb_coeffs = []
        for slice_, group in zip(self._group_slices(), self.param_groups, strict=True):
            beta1, beta2 = group["betas"]
            exp_avgs, exp_avg_sqs = self._states("exp_avg")[slice_], self._states("exp_avg_sq")[slice_]
            foreach_momentum_(exp_avgs, grads[slice_], beta1)
            foreach_variance_(exp_avg_sqs, grads[slice_], beta2)
            group_params, freezes = params[slice_], self._states("lamb_coeff_freeze")[slice_]
            for chunk in foreach_chunks(group_params):  # the update's temporaries: one chunk's, not the group's
                coeffs = onebit_lamb_warmup_update_(
                    group_params[chunk], exp_avgs[chunk], exp_avg_sqs[chunk], freezes[chunk], lr=group["lr"],
                    eps=group["eps"], weight_decay=group["weight_decay"], max_coeff=group["max_coeff"],
                    min_coeff=group["min_coeff"], coeff_beta=self.coeff_beta,
                )
                self._lamb_coeffs.extend(coeffs.unbind())
            if last:
                torch._foreach_copy_(self._states("exp_avg_sq_fresh")[slice_], exp_avg_sqs)
        self._variance_changed()

    def _compressed_step(self) -> None:
        """Momentum update, one fused compressed call, then the frozen-coefficient update, on flat buffers.

        DeepSpeed keeps a clone of every momentum for the reconstructed gradient. Here the dead gradients hold
        `beta1 m_old` instead (swapped with the momentum through the bounded work buffer, chunk by chunk), while
        the home buffer takes the new momentum `m_new = beta1 m_old + (1 - beta1) g` with DeepSpeed's single
        rounding; they then serve as scratch for the reconstructed gradient and the update direction. The home
        buffer's padded tail, last step's output, feeds this compression as in DeepSpeed. Every op runs over a
        list (a chunk, a group, all tensors): the number of ops does not grow with the number of tensors.
        """
        params, grads = self._params(), self._grads()
        if "scaling_coeff" not in self.state[params[0]]:
            self._init_scaling_coeffs(params)
        scaling = self._states("scaling_coeff")
        momenta = self._states("exp_avg")
        for slice_, group in zip(self._group_slices(), self.param_groups, strict=True):
            beta1 = group["betas"][0]
            for m, g, old in self._chunks(momenta[slice_], grads[slice_]):
                torch._foreach_copy_(old, g)
                torch._foreach_mul_(m, beta1)  # beta1 m_old, kept for the reconstructed gradient
                torch._foreach_copy_(g, m)
                torch._foreach_add_(m, old, alpha=1 - beta1)
        torch._foreach_mul_(momenta, scaling)
        self.buckets.allreduce_()
        torch._foreach_div_(momenta, scaling)
        self._mask_(self.buckets.flats)
        self._lamb_coeffs = []
        denoms = self._denominators()
        fresh = self._states("exp_avg_sq_fresh")
        for slice_, group in zip(self._group_slices(), self.param_groups, strict=True):
            coeffs = onebit_lamb_compressed_update_(
                params[slice_], grads[slice_], momenta[slice_], fresh[slice_], denoms[slice_], self._chunks,
                self._states("lamb_coeff_freeze")[slice_], self._states("last_factor")[slice_], lr=group["lr"],
                betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                factor_max=self.factor_max, factor_min=self.factor_min, factor_threshold=self.factor_threshold,
            )
            self._lamb_coeffs.extend(coeffs.unbind())

    def _init_scaling_coeffs(self, params: list[Tensor]) -> None:
        """Each tensor's `scaling_coeff` at the first compression step (1 without scaling)."""
        if self.scaled:
            coeffs = momentum_scaling_coeffs(self._states("exp_avg")).unbind()
        else:
            coeffs = torch.ones(len(params), dtype=torch.float64, device=params[0].device).unbind()
        for p, coeff in zip(params, coeffs, strict=True):
            self.state[p]["scaling_coeff"] = coeff

    def _chunks(self, *lists: list[Tensor]) -> Iterator[tuple[list[Tensor], ...]]:
        """Aligned chunks of same-shaped `lists` of at most `_chunk_numel` elements (a larger contiguous tensor cut
        into 1-D pieces), each with a list of temporaries shaped like it: views of one bounded work buffer."""
        if not lists[0]:
            return
        pieces = _aligned_pieces(lists, self._chunk_numel)
        for chunk in foreach_chunks(pieces[0], self._chunk_numel):
            yield *(tensors[chunk] for tensors in pieces), self._scratch_views(pieces[0][chunk])

    def _scratch_views(self, tensors: list[Tensor]) -> list[Tensor]:
        """Views of the work buffer shaped like `tensors`, cached by shape (no op per step); fresh tensors for
        what does not fit (a large tensor that is not contiguous, taken whole)."""
        shapes = tuple(t.shape for t in tensors)
        if shapes not in self._scratch_cache:
            numels = [t.numel() for t in tensors]
            if sum(numels) > self._chunk_numel:
                return [torch.empty_like(t) for t in tensors]
            if self._scratch is None:
                self._scratch = torch.empty(self._chunk_numel, dtype=tensors[0].dtype, device=tensors[0].device)
            flat = self._scratch[:sum(numels)].split(numels)
            self._scratch_cache[shapes] = [view.view(shape) for view, shape in zip(flat, shapes, strict=True)]
        return self._scratch_cache[shapes]

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        for p in self._params():  # checkpoints before scaling coefficients were tensors held Python floats
            if isinstance(self.state[p].get("scaling_coeff"), float):
                self.state[p]["scaling_coeff"] = torch.tensor(self.state[p]["scaling_coeff"], dtype=torch.float64,
                                                              device=p.device)


def momentum_scaling_coeffs(exp_avgs: list[Tensor]) -> Tensor:
    """`mean_q rms(m_q) / rms(m_p)` per tensor (float64, one entry per tensor), so one worker scale suits every
    momentum in the buffer.

    Computed once, at the first compression step, on the device in float64 (no host read). The sum is a
    cumulative sum, left to right as DeepSpeed's Python floats are on a CPU. A zero RMS gets coefficient 1.
    """
    norms = torch.stack(torch._foreach_norm(exp_avgs)).double()
    rms = torch.stack(torch._foreach_div(list(norms.unbind()), [math.sqrt(m.numel()) for m in exp_avgs]))
    united = rms.cumsum(0)[-1] / len(exp_avgs)
    return torch.where(rms > 0, united / rms, torch.ones_like(rms))


def onebit_lamb_warmup_update_(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                               coeff_freezes: list[Tensor], *, lr: float, eps: float, weight_decay: float,
                               max_coeff: float, min_coeff: float, coeff_beta: float) -> Tensor:
    """LAMB step without bias correction; updates the frozen-coefficient EMAs; returns the coefficients."""
    if not params:
        return torch.empty(0)
    weight_norms = torch.stack(torch._foreach_norm(params))
    updates, _ = foreach_adam_update(params, exp_avgs, exp_avg_sqs, eps, weight_decay if weight_decay > 0 else 0.0)
    coeffs = clamped_trust_ratio(weight_norms, torch.stack(torch._foreach_norm(updates)), max_coeff, min_coeff)
    frozen = torch.stack(coeff_freezes)
    blended = torch.where(coeffs != 1.0, coeff_beta * frozen + (1.0 - coeff_beta) * coeffs, frozen)
    torch._foreach_copy_(coeff_freezes, list(blended.unbind()))
    torch._foreach_addcmul_(params, updates, list((coeffs * -lr).float().unbind()))
    return coeffs


def onebit_lamb_compressed_update_(params: list[Tensor], work: list[Tensor], exp_avgs: list[Tensor],
                                   fresh: list[Tensor], denoms: list[Tensor], chunks: Chunks,
                                   coeff_freezes: list[Tensor], last_factors: list[Tensor], *, lr: float,
                                   betas: Sequence[float], eps: float, weight_decay: float, factor_max: float,
                                   factor_min: float, factor_threshold: float) -> Tensor:
    """One group's compression-stage update after the momenta were all-reduced; returns each tensor's coefficient.

    `work` (the dead gradients) holds `beta1 m_old` and then, in place, the reconstructed gradient, the ratio
    of denominators and the update; `fresh` is `v_fresh`, `denoms` `sqrt(v) + eps`; `chunks(*lists)` gives
    aligned chunks of lists, each with bounded temporaries shaped like it. Nothing is allocated at full size, and
    every op runs over a list, so their number does not grow with the tensors'. Per-tensor maxima, norms and the
    factor chain run over stacked 0-d tensors (float64): nothing is read on the host. The roundings are
    DeepSpeed's (negating numerator and denominator of the reconstructed gradient is exact).
    """
    if not params:
        return torch.empty(0, dtype=torch.float64)
    beta1, beta2 = betas
    torch._foreach_sub_(work, exp_avgs)
    torch._foreach_div_(work, beta1 - 1)  # reconstructed gradient (m - beta1 m_old) / (1 - beta1)
    torch._foreach_mul_(fresh, beta2)
    torch._foreach_addcmul_(fresh, work, work, value=1 - beta2)
    torch._foreach_copy_(work, fresh)
    torch._foreach_sqrt_(work)
    torch._foreach_add_(work, eps)
    for w, denom, ratio in chunks(work, denoms):  # w <- denom / w, through the temporaries
        torch._foreach_copy_(ratio, denom)
        torch._foreach_div_(ratio, w)
        torch._foreach_copy_(w, ratio)
    factor = torch.stack(torch._foreach_max(work)).double()  # max over elements of denom / fresh denom
    torch._foreach_zero_(work)
    torch._foreach_addcdiv_(work, exp_avgs, denoms)  # update_prelim = m / denom (0 + m / denom: one rounding)
    if weight_decay > 0:
        prelim_norm = torch.stack(torch._foreach_norm(work))
        for w, p, decay in chunks(work, params):  # update = update_prelim + (weight_decay w), rounded apart
            torch._foreach_copy_(decay, p)
            torch._foreach_mul_(decay, weight_decay)
            torch._foreach_add_(w, decay)
        update_norm = torch.stack(torch._foreach_norm(work))
        ratio = torch.where(update_norm > 0, prelim_norm / update_norm, 1.0).double().clamp(max=1.0)
        factor = factor * ratio + (1.0 - ratio)
    factor = factor.clamp(min=factor_min, max=factor_max)
    last = torch.stack(last_factors)
    factor = torch.minimum(torch.maximum(factor, last * (1.0 - factor_threshold)), last * (1.0 + factor_threshold))
    torch._foreach_copy_(last_factors, list(factor.unbind()))
    coeffs = torch.stack(coeff_freezes) * factor
    torch._foreach_mul_(work, list((coeffs * -lr).float().unbind()))
    torch._foreach_add_(params, work)
    return coeffs


def _aligned_pieces(lists: Sequence[list[Tensor]], size: int) -> list[list[Tensor]]:
    """`lists` of same-shaped tensors with each tensor of more than `size` elements replaced by its 1-D pieces of at
    most `size`, alike in every list; kept whole where one of them is not contiguous (a channels_last gradient,
    say: no flat view of it exists). Two ops per cut tensor: a view and one split."""
    out: list[list[Tensor]] = [[] for _ in lists]
    for tensors in zip(*lists, strict=True):
        cut = tensors[0].numel() > size and all(t.is_contiguous() for t in tensors)
        for pieces, t in zip(out, tensors, strict=True):
            if cut:
                pieces.extend(t.view(-1).split(size))
            else:
                pieces.append(t)
    return out


register_optimizer(OptimSpec(
    "onebit_lamb", OneBitLAMB, "self", check=check_onebit_lamb_options, warmup_option="freeze_step",
    restart_refusal=ONEBIT_RESTART_REFUSAL,
    state_bytes_per_param=onebit_family_bytes(4),  # m, v, fresh v, sqrt(v) + eps (the work piece is bounded)
    description="1-bit LAMB (DeepSpeed 0.19.6 semantics): LAMB warm-up, then fused 1-bit momentum, frozen coefficients",
))
