"""0/1 Adam (Lu et al., ICLR 2023): adaptive variance freezing, 1-bit gradients, then local steps with 1-bit syncs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor

from core.options import require
from optim._compiled import CompiledMath, device_scalars, graph_chunks
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import Comm
from optim.memory import onebit_family_bytes
from optim.onebit_adam import (
    DIFFERENCES_FROM_DEEPSPEED,
    ONEBIT_RESTART_REFUSAL,
    OneBitFamily,
    check_onebit_family_options,
)

StepKind = Literal["init", "variance", "onebit_grad", "sync", "local"]


@dataclass
class ZeroOneSchedule:
    """DeepSpeed 0.19.6's communication policy for 0/1 Adam as a small state machine.

    Phase 1: step t refreshes the variance with an exact mean gradient iff `t % var_interval == 0`
    ("variance"), otherwise it 1-bit all-reduces the local gradient ("onebit_grad"); every
    `var_update_scaler` variance steps the interval doubles. After the first step with
    `t > var_freeze_step` phase 2 begins: a 1-bit sync of the accumulated update iff
    `t % local_step_interval == 0` ("sync"), otherwise no communication ("local"); the interval doubles
    every `local_step_scaler` phase-2 steps (steps, not syncs), up to `local_step_clipper`.
    """

    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    var_interval: int = 1
    var_counter: int = 0
    local_step_interval: int = 1
    local_step_counter: int = 0
    frozen: bool = False

    def kind(self, t: int) -> StepKind:
        if not self.frozen:
            return "variance" if t % self.var_interval == 0 else "onebit_grad"
        return "sync" if t % self.local_step_interval == 0 else "local"

    def advance(self, t: int) -> bool:
        """Bookkeeping at the end of real step `t`; True when phase 2 begins with the next step."""
        if not self.frozen:
            if t % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter = 0
                    self.var_interval *= 2
            if t > self.var_freeze_step:
                self.frozen = True
                return True
            return False
        self.local_step_counter += 1
        if self.local_step_counter == self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(self.local_step_clipper, 2 * self.local_step_interval)
        return False


def zero_one_adam_step_kinds(steps: int, var_freeze_step: int, var_update_scaler: int = 16,
                             local_step_scaler: int = 32678, local_step_clipper: int = 16,
                             init_noop_step: bool = True) -> list[StepKind]:
    """What each of `steps` optimizer steps communicates, replayed without any tensors (for volume studies)."""
    schedule = ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
    return list(_replay(schedule, range(1, steps + 1), init_noop_step))


def _replay(schedule: ZeroOneSchedule, steps: range, init_noop_step: bool) -> Iterator[StepKind]:
    """The kind of each step of `steps`, advancing `schedule`, which must stand before the first of them."""
    for t in steps:
        if init_noop_step and t == 1:
            yield "init"
            continue
        yield schedule.kind(t)
        schedule.advance(t)


def check_zero_one_adam_options(options: dict[str, Any]) -> None:
    """0/1 Adam's value checks, run by its constructor and, through the registry, on the config."""
    check_onebit_family_options(options, freeze_key="var_freeze_step")
    for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
        require(isinstance(options[key], int) and options[key] >= 1, key, options[key], "must be an integer >= 1")


class ZeroOneAdam(OneBitFamily):
    r"""0/1 Adam (Lu, Li, Zhang, De Sa, He; ICLR 2023, arXiv 2202.06009), with DeepSpeed 0.19.6's semantics.

    With :math:`t` counting steps including the no-op init step and the schedule of `ZeroOneSchedule`:

    - Phase 1, variance step: :math:`\bar g` = exact mean gradient; :math:`v \leftarrow \beta_2 v +
      (1-\beta_2)\bar g^2`, :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`.
    - Phase 1, other steps: :math:`\hat g = C(g_{local})` (1-bit, error-compensated, masked),
      :math:`m \leftarrow \beta_1 m + (1-\beta_1)\hat g`; :math:`v` unchanged.
    - Phase 2 (errors zeroed once on entry), every step: :math:`m \leftarrow \beta_1 m + (1-\beta_1)
      g_{local}`, :math:`w \leftarrow w - \eta u_t` with :math:`u_t = m/(\sqrt v+\epsilon) + \lambda w`.
      On a sync step, with :math:`w_a` the parameters after the last sync and
      :math:`\Lambda = \sum \eta` since then: :math:`q = (w - w_a)(\sqrt v + \epsilon)` (weight decay leaks
      into :math:`q`, as in DeepSpeed), :math:`\bar q = C(q)` masked, :math:`m \leftarrow -\bar q/\Lambda`,
      :math:`w \leftarrow w_a + \bar q/(\sqrt v+\epsilon)`.
    - Every real step of phase 1 uses the same Adam update (no bias correction, decoupled decay).

    Replicas are identical after every phase-1 step and every sync; between syncs they differ.

    Args:
        params: parameters or param groups (``exp_avg_mask`` as in DeepSpeed).
        lr, betas, eps, weight_decay: as in `OneBitAdam`.
        var_freeze_step: phase 2 starts after the first step with t > var_freeze_step.
        var_update_scaler: variance steps between doublings of the variance interval (kappa).
        local_step_scaler: phase-2 steps between doublings of the sync interval (alpha; DeepSpeed's default
            32678 is kept).
        local_step_clipper: the largest sync interval (H).
        bucketing, init_noop_step, mask_zero_variance, dense_comm_dtype, compiled, triton, comm: as in
            `OneBitAdam`.
    """

    __doc__ = (__doc__ or "") + DIFFERENCES_FROM_DEEPSPEED + """
    - 0/1 Adam: instead of DeepSpeed's running sum u of the local updates we keep the parameters of the last
      sync, w_a, and form u = w - w_a at a sync (same memory, one pass fewer per local step). The rollback
      then lands exactly on w_a, so replicas are bit-identical after a sync (DeepSpeed: ~1e-6 apart); u
      differs from DeepSpeed's running sum by rounding.
    - 0/1 Adam: the per-tensor counters of DeepSpeed are one optimizer-wide schedule (`ZeroOneSchedule`);
      the sum of learning rates is kept per param group.
    """

    def __init__(self, params: Any, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, bucketing: str = "per_group",
                 init_noop_step: bool = True, mask_zero_variance: bool = True, dense_comm_dtype: str = "fp32",
                 compiled: bool = False, triton: bool | None = False, comm: Comm | None = None) -> None:
        run_check(type(self).__name__, check_zero_one_adam_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper, bucketing=bucketing, init_noop_step=init_noop_step,
            mask_zero_variance=mask_zero_variance, dense_comm_dtype=dense_comm_dtype, compiled=compiled,
            triton=triton,
        ))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, comm, bucketing, init_noop_step, mask_zero_variance, dense_comm_dtype,
                         compiled, triton, flat_keys=("exp_avg_sq", "sync_anchor"))  # w_a, set in phase 2
        self.schedule = ZeroOneSchedule(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
        self.lr_sums = [0.0] * len(self.param_groups)

    def _step(self, t: int) -> None:
        grads = self._grads()
        kind = self.schedule.kind(t)
        if self.schedule.frozen:
            self.lr_sums = [total + group["lr"] for total, group in zip(self.lr_sums, self.param_groups, strict=True)]
        if kind == "sync" and not self.deepspeed_roundings and all(self.lr_sums):
            self._step_and_sync_fused(grads)
        else:
            if kind == "variance":
                self._average(grads)
                self._variance_(grads)
                self._momentum_(grads)
            elif kind == "onebit_grad":  # phase 1: the anchors' buffer is free and receives the 1-bit mean
                torch._foreach_add_(self.buckets.worker_views, grads)  # g + error, as DeepSpeed's buffer + error
                self._compressed_mean_("sync_anchor", fed_back=True)
                self._mask_("sync_anchor")
                self._momentum_(self._states("sync_anchor"))
            else:
                self._momentum_(grads)
            self._adam_update_(grads)
            if kind == "sync":
                self._sync()
        if self.schedule.advance(t):  # phase 2 from the next step: errors now track u, not gradients
            self.buckets.zero_errors_()
            torch._foreach_copy_(self._states("sync_anchor"), self._params())

    def _sync(self) -> None:
        """Average the accumulated updates with one compressed call and restart from the common point.

        The momentum is replaced by the averaged update at a sync, so its buffer carries q: no copy, no
        temporary. Roundings as before: q = (w - w_a) (sqrt(v) + eps); w = w_a + q / (sqrt(v) + eps).
        """
        params, anchors, denoms = self._params(), self._states("sync_anchor"), self._denominators()
        accumulated = self._states("exp_avg")
        torch._foreach_copy_(accumulated, params)
        torch._foreach_sub_(accumulated, anchors)  # u: what this rank moved since the last sync
        torch._foreach_mul_(accumulated, denoms)  # q = u (sqrt(v) + eps)
        self._compressed_mean_("exp_avg")
        self._mask_("exp_avg")
        torch._foreach_addcdiv_(anchors, accumulated, denoms)  # w = w_a + q / (sqrt(v) + eps)
        torch._foreach_copy_(params, anchors)
        for group, momentum in self.flat.segments("exp_avg"):
            momentum.div_(-self.lr_sums[group])  # m = -q / sum(lr)
        self.lr_sums = [0.0] * len(self.param_groups)

    def _step_and_sync_fused(self, grads: list[Tensor]) -> None:
        """A sync step's momentum, Adam update and sync in fewer passes (the fused roundings; `_sync` has the
        exact ones).

        The weights are overwritten by the sync, so the update need not land in them: with `m' = lerp(m, g)`,
        `q = (w' - w_a) d = (w - w_a) d - lr m' - lr wd w d` goes straight into the worker error (`fed_back`), and
        the weights hold `w - w_a` meanwhile. The decoding divides by `-sum(lr)`, so the momentum buffer
        receives `m = -q_bar / sum(lr)` (bit for bit DeepSpeed's), and `w_a + q_bar / d` is formed from it.

        Bytes, in passes over one fp32 vector of N (BERT-Large, 2 ranks; the floor, 9: w, m, v, w_a read and
        written, g read): the momentum lerp 3, `w - w_a` 3, `q` into the error 4 + 3, the compression about 13.4
        (the norm, the sign bits, the error's multiply-add, the server's sum and compression, the decoding with the
        mask), `w_a + q_bar / d` 4 and the weights' copy 2: about 32.4, 3.6x. Aten ops read and write their
        operands once each; a fused kernel would need each of them once in all.
        """
        params, anchors, denoms, errors = self._params(), self._states("sync_anchor"), self._denominators(), \
            self.buckets.worker_views
        momenta = self._states("exp_avg")
        if self.compiled or self.triton:
            self._step_and_sync_in_two_passes(params, grads, momenta, anchors, denoms, errors)
            return
        self._momentum_(grads)
        for slice_, group in self._groups():
            if group["weight_decay"] != 0:
                torch._foreach_addcmul_(errors[slice_], params[slice_], denoms[slice_],
                                        value=-group["lr"] * group["weight_decay"])
        torch._foreach_sub_(params, anchors)
        torch._foreach_addcmul_(errors, params, denoms)
        for slice_, group in self._groups():
            torch._foreach_add_(errors[slice_], momenta[slice_], alpha=-group["lr"])
        self._compressed_mean_("exp_avg", fed_back=True,
                               divisors=[-self.lr_sums[group] for group in self.bucket_groups])
        self._mask_("exp_avg")
        for (slice_, _), lr_sum in zip(self._groups(), self.lr_sums, strict=True):
            torch._foreach_addcdiv_(anchors[slice_], momenta[slice_], denoms[slice_], value=-lr_sum)
        torch._foreach_copy_(params, anchors)
        self.lr_sums = [0.0] * len(self.param_groups)

    def _step_and_sync_in_two_passes(self, params: list[Tensor], grads: list[Tensor], momenta: list[Tensor],
                                     anchors: list[Tensor], denoms: list[Tensor], errors: list[Tensor]) -> None:
        """`_step_and_sync_fused` in two passes around the compressed call, per param group, compiled (per chunk of
        the group's tensors) or in Triton kernels (`optim._triton_zero_one_adam`, one launch for all of them): the
        momentum and `q` into the error (w, g, m, w_a, the denominator and the error read, m and the error written:
        8, where the aten ops take 13 to 17; the weights are left alone, the sync overwrites them), then
        `w_a + q_bar / d` into the anchors and the weights (5, not 6)."""
        if self.triton:
            from optim._triton_zero_one_adam import sync_error, sync_weights  # imports triton: `use_triton` allowed it
        device = self.flat.device
        for slice_, group in self._groups():
            lists = [t[slice_] for t in (params, grads, momenta, anchors, denoms, errors)]
            beta1, weight_decay = group["betas"][0], group["weight_decay"]
            if self.triton:
                sync_error(*lists, beta1, group["lr"], weight_decay)
                continue
            lr, = device_scalars(device, group["lr"])
            for chunk in graph_chunks(lists[0]):
                _SYNC_ERROR(*(t[chunk] for t in lists), lr, beta1=beta1, weight_decay=weight_decay)
        self._compressed_mean_("exp_avg", fed_back=True,
                               divisors=[-self.lr_sums[group] for group in self.bucket_groups])
        self._mask_("exp_avg")
        for (slice_, _), lr_sum in zip(self._groups(), self.lr_sums, strict=True):
            lists = [t[slice_] for t in (params, anchors, momenta, denoms)]
            if self.triton:
                sync_weights(*lists, lr_sum)
                continue
            total, = device_scalars(device, lr_sum)
            for chunk in graph_chunks(lists[0]):
                _SYNC_WEIGHTS(*(t[chunk] for t in lists), total)
        self.lr_sums = [0.0] * len(self.param_groups)

    def replicas_agree_after(self, step: int) -> bool:
        """Whether every rank holds the same weights after step `step` (`OptimSpec.replicas_agree_after`): after
        every phase-1 step and every sync, not after a local step.

        The schedule depends on the step number alone, so a later step is answered by replaying a copy of the
        current schedule (exact as long as the policy options stay as they are), an earlier one by replaying it
        from its start with this run's policy (a resume that changed the policy would make that answer wrong; the
        trainer asks only the current step and later ones). The current step is answered from the state: a local
        step adds its learning rate to `lr_sums` and a sync zeroes them, so the weights moved apart since the last
        sync iff a sum is not 0. A later local step is answered False even if its learning rates will be 0.
        """
        if step == self.step_count:
            return not any(self.lr_sums)
        if step == 0:
            return True
        if step > self.step_count:
            schedule, first = replace(self.schedule), self.step_count + 1
        else:
            s = self.schedule
            schedule = ZeroOneSchedule(s.var_freeze_step, s.var_update_scaler, s.local_step_scaler,
                                       s.local_step_clipper)
            first = 1
        *_, kind = _replay(schedule, range(first, step + 1), self.init_noop_step)
        return kind != "local"

    def _extra_state(self) -> dict[str, Any]:
        return {"schedule": asdict(self.schedule), "lr_sums": list(self.lr_sums)}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        saved = dict(state["schedule"])
        for key in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"):
            saved[key] = getattr(self.schedule, key)  # the policy comes from this run's config
        self.schedule = ZeroOneSchedule(**saved)
        self.lr_sums = list(state["lr_sums"])


register_optimizer(OptimSpec(
    "zero_one_adam", ZeroOneAdam, "self", check=check_zero_one_adam_options, restart_refusal=ONEBIT_RESTART_REFUSAL,
    replicas_agree_after=ZeroOneAdam.replicas_agree_after,
    state_bytes_per_param=onebit_family_bytes(4),  # m, v, sync anchor w_a, sqrt(v) + eps
    description="0/1 Adam (DeepSpeed 0.19.6 semantics): adaptive variance freezing, 1-bit gradients, "
                "1-bit syncs after local steps",
))


def _sync_error_(params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], anchors: list[Tensor],
                 denoms: list[Tensor], errors: list[Tensor], lr: Tensor, *, beta1: float, weight_decay: float) -> None:
    """A fused sync's first pass, traced for inductor: `m = lerp(m, g)` and `error += (w - w_a) d - lr m'
    - lr wd w d`, in `_step_and_sync_fused`'s order."""
    for w, g, m, anchor, d, error in zip(params, grads, momenta, anchors, denoms, errors, strict=True):
        m.lerp_(g, 1.0 - beta1)
        if weight_decay != 0:
            error.add_(w * d * (-lr * weight_decay))
        error.add_((w - anchor) * d).add_(m * -lr)


def _sync_weights_(params: list[Tensor], anchors: list[Tensor], momenta: list[Tensor], denoms: list[Tensor],
                   lr_sum: Tensor) -> None:
    """A fused sync's last pass, traced for inductor: `w = w_a = w_a - sum(lr) m / d` (m holds `-q_bar / sum(lr)`)."""
    for w, anchor, m, d in zip(params, anchors, momenta, denoms, strict=True):
        anchor.sub_(m / d * lr_sum)
        w.copy_(anchor)


_SYNC_ERROR = CompiledMath(_sync_error_)
_SYNC_WEIGHTS = CompiledMath(_sync_weights_)
