"""1-bit LAMB (Li et al. 2021): LAMB warm-up, then 1-bit compressed momentum with frozen LAMB coefficients."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from core.options import check_non_negative, check_positive, require
from optim._compiled import CompiledMath, graph_chunks
from optim._math import (
    clamped_trust_ratio,
    foreach_adam_update,
)
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import Comm
from optim.flat import foreach_chunks
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


# 1-bit LAMB's one work buffer, what replaces DeepSpeed's clone of every momentum: its compressed step runs over
# chunks of the flat buffers of at most this many elements (`optim.flat`: a larger tensor is cut into 1-D pieces),
# each with a view of the buffer as its temporary. It holds an eighth of the parameters, at most 64 MiB of fp32: a
# bounded buffer, and a step of at most about 16 chunks plus one per 2^24 elements, however many tensors there are.
# Smaller, cache-sized chunks do not pay on a CPU (BERT-base, one thread: 2^20 elements per chunk no faster than
# 2^24 or whole lists) and only multiply the launches on a GPU.
_SCRATCH_NUMEL, _SCRATCH_FRACTION = 1 << 24, 8


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
        init_noop_step, mask_zero_variance, dense_comm_dtype, compiled, triton, comm: as in `OneBitAdam`.
    """

    __doc__ = (__doc__ or "") + DIFFERENCES_FROM_DEEPSPEED + """
    - 1-bit LAMB: a momentum whose RMS is 0 at the first compression step gets scaling coefficient 1
      (DeepSpeed divides by 0).
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, bucketing: str = "flat_scaled", init_noop_step: bool = True,
                 mask_zero_variance: bool = True, dense_comm_dtype: str = "fp32", compiled: bool = False,
                 triton: bool | None = False, comm: Comm | None = None) -> None:
        run_check(type(self).__name__, check_onebit_lamb_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step, max_coeff=max_coeff,
            min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
            factor_threshold=factor_threshold, bucketing=bucketing, init_noop_step=init_noop_step,
            mask_zero_variance=mask_zero_variance, dense_comm_dtype=dense_comm_dtype, compiled=compiled,
            triton=triton,
        ))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        super().__init__(params, defaults, comm, bucketing, init_noop_step, mask_zero_variance, dense_comm_dtype,
                         compiled, triton, keep_tail=bucketing == "flat_scaled",
                         flat_keys=("exp_avg_sq", "exp_avg_sq_fresh"))
        self.scaled = bucketing == "flat_scaled"
        self._lamb_coeffs: list[Tensor] = []
        numel = sum(p.numel() for p in self._params())
        self._chunk_numel = min(_SCRATCH_NUMEL, -(-numel // _SCRATCH_FRACTION))
        self._scratch: Tensor | None = None  # the bounded work buffer, made at the first compressed step
        self._work_views: list[tuple[Tensor, list[Tensor]]] | None = None
        self._one = torch.ones((), dtype=self.flat.dtype, device=self.flat.device)  # a factor of exactly 1

    def _init_state(self, state: dict[str, Any], p: Tensor) -> None:
        state["lamb_coeff_freeze"] = torch.zeros((), dtype=torch.float64, device=p.device)
        state["last_factor"] = torch.ones((), dtype=torch.float64, device=p.device)

    def compressing(self, t: int) -> bool:
        return t > max(self.freeze_step, self.first_real_step)

    def lamb_coeffs(self) -> list[float]:
        """The coefficient each tensor's update was scaled by in the last step (a copy; reads the device)."""
        return [float(c) for c in self._lamb_coeffs]

    def memory_bytes(self) -> dict[str, int]:
        scratch = 0 if self._scratch is None else self._scratch.numel() * self._scratch.element_size()
        return {**super().memory_bytes(), "scratch": scratch}

    def _per_param(self, key: str) -> list[Tensor]:
        """Every parameter's entry `key` of its (non-flat) state: its scalars."""
        return [self.state[p][key] for p in self._params()]

    def _step(self, t: int) -> None:
        if self.compressing(t):
            self._compressed_step()
        else:
            self._warmup_step(last=t == max(self.freeze_step, self.first_real_step))

    def _warmup_step(self, last: bool) -> None:
        params, grads = self._params(), self._grads()
        self._average(grads)
        self._momentum_(grads)
        self._variance_(grads)
        self._lamb_coeffs = []
        exp_avgs, exp_avg_sqs = self._states("exp_avg"), self._states("exp_avg_sq")
        freezes = self._per_param("lamb_coeff_freeze")
        for slice_, group in self._groups():
            for part in foreach_chunks(params[slice_]):  # the update's temporaries: one chunk's, not the group's
                chunk = slice(slice_.start + part.start, slice_.start + part.stop)
                coeffs = onebit_lamb_warmup_update_(
                    params[chunk], exp_avgs[chunk], exp_avg_sqs[chunk], freezes[chunk], lr=group["lr"],
                    eps=group["eps"], weight_decay=group["weight_decay"], max_coeff=group["max_coeff"],
                    min_coeff=group["min_coeff"], coeff_beta=self.coeff_beta,
                )
                self._lamb_coeffs.extend(coeffs.unbind())
        if last:
            for (_, fresh), (_, variance) in zip(self.flat.segments("exp_avg_sq_fresh"),
                                                 self.flat.segments("exp_avg_sq"), strict=True):
                fresh.copy_(variance)

    def _compressed_step(self) -> None:
        """Momentum update, one fused compressed call, then the frozen-coefficient update, on flat buffers.

        DeepSpeed keeps a clone of every momentum for the reconstructed gradient. Here the dead gradients hold the
        old momentum instead, while the flat buffer takes the new one; they then serve as scratch for the
        reconstructed gradient and the update direction. With DeepSpeed's roundings the old momentum is swapped
        in through the bounded work buffer, a chunk at a time. With the fused ones the new momentum is formed in
        the gradients' storage, goes scaled straight into the worker error (`fed_back`: the compression's own
        addition is that pass) and the old one is copied over it: 8 passes of N where the swap, the scaling and
        the addition take 12. The buffer's padded tail, last step's output, feeds this compression as in
        DeepSpeed. Every op runs over a segment, a chunk or a list: the number of ops does not grow with the
        number of tensors.
        """
        params, grads = self._params(), self._grads()
        if "scaling_coeff" not in self.state[params[0]]:
            self._init_scaling_coeffs(params)
        scaling, momenta = self._per_param("scaling_coeff"), self._states("exp_avg")
        if self.compiled:
            self._compiled_compressed_step(params, grads, scaling, momenta)
            return
        factors = torch.stack(scaling) if self.triton else scaling  # the kernels read one vector
        if self.deepspeed_roundings:
            self._swap_in_momenta_(grads)
            torch._foreach_mul_(momenta, scaling)
            self._compressed_mean_("exp_avg")
        else:
            for slice_, group in self._groups():  # the new momentum in the gradients' storage, for a moment
                torch._foreach_lerp_(grads[slice_], momenta[slice_], group["betas"][0])
            multiply_add_(self.buckets.worker_views, grads, factors)  # error + m s
            torch._foreach_copy_(grads, momenta)  # the old momentum, exactly: every rank reconstructs alike
            self._compressed_mean_("exp_avg", fed_back=True)
        if self.triton and all(self._group_mask(group) is None for group in self.param_groups):
            self._triton_update(params, grads, factors, momenta)
            return
        if self.triton:
            from optim._triton_tensorwise import per_tensor_divide  # imports triton: `triton_refusal` allowed it

            per_tensor_divide(momenta, factors)
        else:
            torch._foreach_div_(momenta, scaling)
        self._mask_("exp_avg")
        fresh = self._states("exp_avg_sq_fresh")
        for slice_, group in self._groups():
            refresh_variance_(grads[slice_], momenta[slice_], fresh[slice_], group["betas"], self.deepspeed_roundings)
        maxima = self._ratio_maxima()
        denoms, ones = self._denominators(), [self._one] * len(params)
        freezes, last_factors = self._per_param("lamb_coeff_freeze"), self._per_param("last_factor")
        self._lamb_coeffs = []
        for slice_, group in self._groups():
            coeffs = onebit_lamb_compressed_update_(
                params[slice_], grads[slice_], momenta[slice_], denoms[slice_], maxima[slice_], freezes[slice_],
                last_factors[slice_], ones[slice_], lr=group["lr"], weight_decay=group["weight_decay"],
                factor_max=self.factor_max, factor_min=self.factor_min, factor_threshold=self.factor_threshold,
                deepspeed_roundings=self.deepspeed_roundings, triton=self.triton,
            )
            self._lamb_coeffs.extend(coeffs.unbind())

    def _compiled_compressed_step(self, params: list[Tensor], grads: list[Tensor], scaling: list[Tensor],
                                  momenta: list[Tensor]) -> None:
        """`_compressed_step` with the fused roundings in three compiled passes per chunk of a group's tensors around
        the compressed call: the scaled new momentum into the worker error and the old one into the gradients'
        storage (g, m and the error read, the error and g written: 5, where the aten ops take 8); the momentum
        unscaled and masked, the fresh variance, the per-tensor maxima of the ratio and the norms of the update
        (m, the old momentum, the fresh variance, the denominator and w read, m and the fresh variance written: 8,
        not about 26); the update formed again and applied (4)."""
        errors, fresh, denoms = self.buckets.worker_views, self._states("exp_avg_sq_fresh"), self._denominators()
        chunks = [(group, [slice(slice_.start + c.start, slice_.start + c.stop) for c in graph_chunks(
            params[slice_])]) for slice_, group in self._groups()]
        for group, pieces in chunks:
            for piece in pieces:
                _FEED_MOMENTUM(grads[piece], momenta[piece], errors[piece], scaling[piece], beta1=group["betas"][0])
        self._compressed_mean_("exp_avg", fed_back=True)
        freezes, last_factors = self._per_param("lamb_coeff_freeze"), self._per_param("last_factor")
        self._lamb_coeffs = []
        for group, pieces in chunks:
            if not pieces[0].stop > pieces[0].start:
                continue
            constants = dict(eps=group["eps"], weight_decay=group["weight_decay"])
            stats = torch.cat([_REFRESH_AND_NORMS(momenta[p], scaling[p], self._group_mask(group), grads[p],
                                                  fresh[p], denoms[p], params[p], betas=group["betas"], **constants)
                               for p in pieces], dim=1)
            span = slice(pieces[0].start, pieces[-1].stop)
            coeffs = self._group_coefficients(group, stats, freezes[span], last_factors[span])
            steps = (coeffs * -group["lr"]).float()
            for p in pieces:
                _APPLY_UPDATE(params[p], momenta[p], denoms[p], steps[p.start - span.start:p.stop - span.start],
                              weight_decay=group["weight_decay"])
            self._lamb_coeffs.extend(coeffs.unbind())

    def _triton_update(self, params: list[Tensor], olds: list[Tensor], factors: Tensor,
                       momenta: list[Tensor]) -> None:
        """The compression stage after the all-reduce in `optim._triton_onebit_lamb`'s kernels, per param group:
        the momentum unscaled, the fresh variance, the ratio maxima and the update's norms in one pass (8 reads and
        writes, where the aten ops take about 26), the update formed again and applied in another (4). Not where a
        group has a momentum mask (`_compressed_step` takes the aten ops there). `factors`: the scaling coefficients
        as one vector."""
        from optim._triton_onebit_lamb import onebit_lamb_apply, refresh_and_stats  # imports triton: allowed

        fresh, denoms = self._states("exp_avg_sq_fresh"), self._denominators()
        freezes, last_factors = self._per_param("lamb_coeff_freeze"), self._per_param("last_factor")
        self._lamb_coeffs = []
        for span, group in self._groups():
            if span.stop == span.start:
                continue
            beta1, beta2 = group["betas"]
            stats = refresh_and_stats(momenta[span], olds[span], fresh[span], denoms[span], params[span],
                                      factors[span], 1.0 / (1.0 - beta1), beta2, group["eps"], group["weight_decay"])
            coeffs = self._group_coefficients(group, stats, freezes[span], last_factors[span])
            onebit_lamb_apply(params[span], momenta[span], denoms[span], (coeffs * -group["lr"]).float(),
                              group["weight_decay"])
            self._lamb_coeffs.extend(coeffs.unbind())

    def _group_coefficients(self, group: dict[str, Any], stats: Tensor, freezes: list[Tensor],
                            last_factors: list[Tensor]) -> Tensor:
        """A group's coefficients from the fused passes' per-tensor statistics (rows: the ratio maxima, the norms of
        `m / denom` and of the update; the norms enter only with weight decay)."""
        norms = stats[1:] if group["weight_decay"] > 0 else (None, None)
        return frozen_coefficients(stats[0], *norms, freezes, last_factors, factor_max=self.factor_max,
                                   factor_min=self.factor_min, factor_threshold=self.factor_threshold)

    def _swap_in_momenta_(self, grads: list[Tensor]) -> None:
        """`m <- beta1 m + (1 - beta1) g` in the flat buffer, with DeepSpeed's roundings, while the gradients'
        storage takes `beta1 m_old`, a chunk at a time through the work buffer."""
        work = self._work()
        momenta = self.flat.pieces("exp_avg", self._chunk_numel)
        flat_momenta = self.flat.chunk_views("exp_avg", self._chunk_numel)
        for chunk, m, flat_m, (flat_w, w) in zip(self.flat.chunks(self._chunk_numel), momenta, flat_momenta, work,
                                                strict=True):
            beta1 = self.param_groups[chunk.group]["betas"][0]
            g = [piece.of(grads[piece.slot]) for piece in chunk.pieces]
            torch.mul(flat_m, beta1, out=flat_w)
            flat_m.copy_(flat_w)
            torch._foreach_add_(m, g, alpha=1.0 - beta1)
            torch._foreach_copy_(g, w)

    def _ratio_maxima(self) -> Tensor:
        """Per tensor, the largest `(sqrt(v) + eps) / (sqrt(v_fresh) + eps)` over its elements: three flat passes
        per chunk through the work buffer, the maxima of cut tensors' pieces combined on the device."""
        self._denominators()
        limit = self._chunk_numel
        maxima = []
        for chunk, fresh, denom, (flat_w, w) in zip(self.flat.chunks(limit), self.flat.chunk_views("exp_avg_sq_fresh",
                                                    limit), self.flat.chunk_views("denom", limit), self._work(),
                                                    strict=True):
            torch.sqrt(fresh, out=flat_w).add_(self.param_groups[chunk.group]["eps"])
            torch.div(denom, flat_w, out=flat_w)
            maxima.extend(torch._foreach_max(w))
        return self.flat.per_slot(maxima, limit, "amax")

    def _work(self) -> list[tuple[Tensor, list[Tensor]]]:
        """Per chunk, the bounded work buffer's flat view and its pieces shaped like the chunk's (built once)."""
        if self._work_views is None:
            self._scratch = torch.empty(self._chunk_numel, dtype=self.flat.dtype, device=self.flat.device)
            self._work_views = []
            for chunk, pieces in zip(self.flat.chunks(self._chunk_numel),
                                     self.flat.pieces("exp_avg", self._chunk_numel), strict=True):
                flat = self._scratch[:chunk.stop - chunk.start]
                parts = flat.split([p.numel() for p in pieces])
                self._work_views.append((flat, [part.view_as(p) for part, p in zip(parts, pieces, strict=True)]))
        return self._work_views

    def _init_scaling_coeffs(self, params: list[Tensor]) -> None:
        """Each tensor's `scaling_coeff` at the first compression step (1 without scaling)."""
        if self.scaled:
            coeffs = momentum_scaling_coeffs(self._states("exp_avg")).unbind()
        else:
            coeffs = torch.ones(len(params), dtype=torch.float64, device=params[0].device).unbind()
        for p, coeff in zip(params, coeffs, strict=True):
            self.state[p]["scaling_coeff"] = coeff

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


def refresh_variance_(work: list[Tensor], exp_avgs: list[Tensor], fresh: list[Tensor], betas: Sequence[float],
                      deepspeed_roundings: bool) -> None:
    """`v_fresh <- beta2 v_fresh + (1 - beta2) g^2` with the reconstructed gradient `g = (m - beta1 m_old) /
    (1 - beta1)`, which `work` takes. `work` holds `beta1 m_old` with DeepSpeed's roundings (then two ops as its,
    negating numerator and denominator: exact), `m_old` otherwise (one extrapolating `lerp`, and the square
    blended in by a second)."""
    beta1, beta2 = betas
    if deepspeed_roundings:
        torch._foreach_sub_(work, exp_avgs)
        torch._foreach_div_(work, beta1 - 1)
        torch._foreach_mul_(fresh, beta2)
        torch._foreach_addcmul_(fresh, work, work, value=1 - beta2)
        return
    torch._foreach_lerp_(work, exp_avgs, 1.0 / (1.0 - beta1))
    torch._foreach_pow_(work, 2.0)
    torch._foreach_lerp_(fresh, work, 1.0 - beta2)


def onebit_lamb_compressed_update_(params: list[Tensor], work: list[Tensor], exp_avgs: list[Tensor],
                                   denoms: list[Tensor], ratio_maxima: Tensor, coeff_freezes: list[Tensor],
                                   last_factors: list[Tensor], ones: list[Tensor], *, lr: float, weight_decay: float,
                                   factor_max: float, factor_min: float, factor_threshold: float,
                                   deepspeed_roundings: bool = True, triton: bool = False) -> Tensor:
    """One group's compression-stage update after the momenta were all-reduced; returns each tensor's coefficient.

    `work` (the dead gradients) takes the update direction; `denoms` is `sqrt(v) + eps`; `ratio_maxima` per tensor
    the largest `denom / (sqrt(v_fresh) + eps)`; `ones` a 0-d 1 per tensor (a factor that keeps DeepSpeed's
    rounding of `weight_decay * w`). Every op runs over a list, so their number does not grow with the tensors'.
    Per-tensor norms and the factor chain run over stacked 0-d tensors (float64): nothing is read on the host.
    `triton`: the fused roundings' last multiply-add in one Triton launch (`multiply_add_`).
    """
    if not params:
        return torch.empty(0, dtype=torch.float64)
    torch._foreach_zero_(work)
    torch._foreach_addcdiv_(work, exp_avgs, denoms)  # update_prelim = m / denom (0 + m / denom: one rounding)
    prelim_norm = update_norm = None
    if weight_decay > 0:
        prelim_norm = torch.stack(torch._foreach_norm(work))
        if deepspeed_roundings:  # update = update_prelim + (weight_decay w), rounded apart
            torch._foreach_addcmul_(work, params, ones, value=weight_decay)
        else:
            torch._foreach_add_(work, params, alpha=weight_decay)
        update_norm = torch.stack(torch._foreach_norm(work))
    coeffs = frozen_coefficients(ratio_maxima, prelim_norm, update_norm, coeff_freezes, last_factors,
                                 factor_max=factor_max, factor_min=factor_min, factor_threshold=factor_threshold)
    steps = (coeffs * -lr).float()
    if deepspeed_roundings:  # w + round(-lr c u): the product rounded before the sum
        torch._foreach_mul_(work, list(steps.unbind()))
        torch._foreach_add_(params, work)
    else:  # one multiply-add (its kernel may round once)
        multiply_add_(params, work, steps if triton else list(steps.unbind()))
    return coeffs


def multiply_add_(outs: list[Tensor], ins: list[Tensor], factors: Tensor | list[Tensor]) -> None:
    """`outs[t] += factors[t] * ins[t]`: for a list of 0-d factors torch's foreach op, which launches a kernel per
    tensor on a GPU; for one vector of them a Triton kernel, one launch (`optim._triton_tensorwise`)."""
    if isinstance(factors, Tensor):
        from optim._triton_tensorwise import per_tensor_multiply_add  # imports triton: `triton_refusal` allowed it

        per_tensor_multiply_add(outs, ins, factors)
    else:
        torch._foreach_addcmul_(outs, ins, factors)


def frozen_coefficients(ratio_maxima: Tensor, prelim_norm: Tensor | None, update_norm: Tensor | None,
                        coeff_freezes: list[Tensor], last_factors: list[Tensor], *, factor_max: float,
                        factor_min: float, factor_threshold: float) -> Tensor:
    """Each tensor's compression-stage coefficient, `lamb_coeff_freeze * factor` (float64), from the maxima of its
    variance ratio and, with weight decay, the norms of `m / denom` and of the update; `last_factors` take the
    factors. Stacked 0-d tensors on the device: nothing is read on the host."""
    factor = ratio_maxima.double()
    if prelim_norm is not None:
        ratio = torch.where(update_norm > 0, prelim_norm / update_norm, 1.0).double().clamp(max=1.0)
        factor = factor * ratio + (1.0 - ratio)
    factor = factor.clamp(min=factor_min, max=factor_max)
    last = torch.stack(last_factors)
    factor = torch.minimum(torch.maximum(factor, last * (1.0 - factor_threshold)), last * (1.0 + factor_threshold))
    torch._foreach_copy_(last_factors, list(factor.unbind()))
    return torch.stack(coeff_freezes) * factor


# ------------------------------------------------------------------------------------------ compiled passes
# `compiled=True`'s compression stage, traced for inductor: the fused roundings' ops, in three passes.


def _feed_momentum_(grads: list[Tensor], momenta: list[Tensor], errors: list[Tensor], scaling: list[Tensor], *,
                    beta1: float) -> None:
    """The new momentum, scaled, added to the worker error; the old one kept in the gradients' storage."""
    for g, m, error, s in zip(grads, momenta, errors, scaling, strict=True):
        error.add_(torch.lerp(g, m, beta1) * s)
        g.copy_(m)


def _refresh_and_norms(momenta: list[Tensor], scaling: list[Tensor], mask: Tensor | None, olds: list[Tensor],
                       fresh: list[Tensor], denoms: list[Tensor], params: list[Tensor], *, betas: Sequence[float],
                       eps: float, weight_decay: float) -> Tensor:
    """The all-reduced momentum unscaled (and masked), `v_fresh` refreshed from the reconstructed gradient, and per
    tensor (a column) the largest `denom / (sqrt(v_fresh) + eps)` and, with weight decay, the norm of `m / denom`
    and that of the update (the maxima again without: the weights are not read)."""
    beta1, beta2 = betas
    stats = []
    for m, s, old, v_fresh, denom, w in zip(momenta, scaling, olds, fresh, denoms, params, strict=True):
        m.div_(s)
        if mask is not None:
            m.mul_(mask)
        v_fresh.lerp_(torch.lerp(old, m, 1.0 / (1.0 - beta1)).pow(2), 1.0 - beta2)
        maximum = torch.amax(denom / (v_fresh.sqrt() + eps))
        if weight_decay > 0:
            prelim = m / denom
            stats.append(torch.stack([maximum, torch.linalg.vector_norm(prelim),
                                      torch.linalg.vector_norm(prelim + weight_decay * w)]))
        else:
            stats.append(maximum.expand(3))
    return torch.stack(stats, dim=1)


def _apply_update_(params: list[Tensor], momenta: list[Tensor], denoms: list[Tensor], steps: Tensor, *,
                   weight_decay: float) -> None:
    """`w += step * u`, the update `u = m / denom + weight_decay w` formed again."""
    for w, m, denom, step in zip(params, momenta, denoms, steps.unbind(), strict=True):
        update = m / denom
        w.add_((update + weight_decay * w if weight_decay > 0 else update) * step)


_FEED_MOMENTUM = CompiledMath(_feed_momentum_)
_REFRESH_AND_NORMS = CompiledMath(_refresh_and_norms, options={"realize_reads_threshold": 1})
_APPLY_UPDATE = CompiledMath(_apply_update_)


register_optimizer(OptimSpec(
    "onebit_lamb", OneBitLAMB, "self", check=check_onebit_lamb_options, warmup_option="freeze_step",
    restart_refusal=ONEBIT_RESTART_REFUSAL,
    state_bytes_per_param=onebit_family_bytes(4),  # m, v, fresh v, sqrt(v) + eps (the work piece is bounded)
    description="1-bit LAMB (DeepSpeed 0.19.6 semantics): LAMB warm-up, then fused 1-bit momentum, frozen coefficients",
))
