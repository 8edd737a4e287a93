"""1-bit Adam (Tang et al. 2021) and the scaffolding the 1-bit family shares: steps, buckets, masks, state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from core.options import check_choice, require
from optim._math import closure_loss, foreach_momentum_, foreach_variance_
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import WIRE_DTYPES, Comm, average_tensors_
from optim.compressed import CompressedBuckets, bucket_layout, padded_numel, zero_codes_
from optim.flat import FlatLayout, FlatState, pop_flat_entries
from optim.memory import onebit_family_bytes
from optim.option_checks import check_adam_hyperparameters, check_flags, check_triton, use_triton

# Kept in every docstring of the family: where we differ from DeepSpeed 0.19.6.
# Elements per bucket of the full-precision gradient average (warm-up, variance steps): DeepSpeed's engine averages
# the whole gradient before the optimizer's step; with `grad_sync = "self"` nothing else has averaged it.
DENSE_BUCKET_NUMEL = 1 << 24

DIFFERENCES_FROM_DEEPSPEED = """
    Deliberate differences from DeepSpeed 0.19.6:

    - Resume is exact: per-rank error buffers, LAMB's padded tail, scaling and frozen coefficients,
      phase flags and every counter are in `state_dict()` (the trainer saves it per rank); the first step
      after a resume is a real step. DeepSpeed drops the errors, re-runs the no-op init step and, for 0/1
      Adam, resets its counters and updates the variance with local gradients (replicas desynchronise).
    - The loss is divided by the accumulation count on every micro-step (the trainer's rule), so the
      compressed stages see the same gradient scale as the warm-up (DeepSpeed 0.16.0-0.18.2 did not).
    - Clipping acts on each rank's local gradient in every stage (`trainer.grad_clip` runs before the
      optimizer averages anything); DeepSpeed clips the averaged gradient in its full-precision stages.
    - The init step (kept: `init_noop_step`) communicates nothing: DeepSpeed averages a gradient it then
      discards and compresses a zero buffer, neither of which changes any number.
    - One compressed all-reduce is two collectives (each scale travels with its signs), not four.
    - A parameter without a gradient is stepped with a zero gradient, so every rank runs the same
      collectives; parameters with no elements are dropped.
    - `mask_zero_variance` (our option, on in conf/optim): elements whose variance is exactly 0 (gradients
      never seen, e.g. BERT's position rows beyond the sequence length) have their communicated values
      zeroed like DeepSpeed's `exp_avg_mask`; otherwise 1-bit noise / eps would move them by huge steps. The
      param-group key `exp_avg_mask` works as in DeepSpeed (in place, never taken from a checkpoint).
    - With one rank the compressed all-reduce is the identity (DeepSpeed skips it and, in 0/1 Adam's
      compressed gradient steps, also skips the momentum update).
    - After `step()` the gradients hold scratch values: their storage carries the update, so a step
      allocates nothing model-sized (zero or drop them before the next backward, as the trainer does).
    - Step boundaries for `freeze_step` < 2 follow our rule (`t > max(freeze_step, first real step)`);
      DeepSpeed needs at least one warm-up step for its freeze check.
"""


def check_onebit_family_options(options: dict[str, Any], bucketings: Sequence[str] = ("per_group", "per_tensor"),
                                freeze_key: str = "freeze_step") -> None:
    """What the family's checks share: Adam's hyper-parameters, the warm-up length, bucketing, the switches."""
    check_adam_hyperparameters(options)
    require(isinstance(options[freeze_key], int) and options[freeze_key] >= 0, freeze_key, options[freeze_key],
            "must be an integer >= 0")
    check_choice("bucketing", repr(options["bucketing"]), [repr(b) for b in bucketings])  # quoted: a string
    check_flags(options, "init_noop_step", "mask_zero_variance")
    check_choice("dense_comm_dtype", repr(options["dense_comm_dtype"]), [repr(d) for d in WIRE_DTYPES])
    check_flags(options, "compiled")
    require(not (options["compiled"] and options["bucketing"] == "per_tensor"), "compiled", True,
            "compiles a graph per bucket: take bucketing per_group (or flat_scaled where offered), or compiled false")
    check_triton(options)


def check_onebit_adam_options(options: dict[str, Any]) -> None:
    """1-bit Adam's value checks, run by its constructor and, through the registry, on the config."""
    check_onebit_family_options(options)


# The family's `OptimSpec.restart_refusal`: its step count places every step in a stage (warm-up, frozen variance
# with compressed momentum and per-rank error feedback), and the saved state belongs to the stage it was written in.
ONEBIT_RESTART_REFUSAL = ("keeps a stage-bound state (frozen variance, compression error buffers) that a fresh step "
                          "count would put in the wrong stage")


class OneBitFamily(torch.optim.Optimizer):
    """What 1-bit Adam, 1-bit LAMB and 0/1 Adam share: the step counter and its no-op init step, the
    tensors of each step, the compressed buckets, the momentum masks, the exact per-rank state.

    Subclasses implement `_step(t)`. The step counter `t` counts `step()` calls including the init step, as
    DeepSpeed's does, so every schedule boundary (freeze_step, variance and local-step intervals) matches.

    Memory layout (`optim.flat`): every per-element state tensor (``exp_avg``, ``exp_avg_sq``, ...) is a view of
    one flat buffer per name, laid out bucket by bucket (each bucket padded for the compressed all-reduce), the
    momentum's the buffer the compressed all-reduce works on: a compressed call copies nothing in or out, and
    math over state alone runs as one op per segment (a param group's run in a bucket). The frozen denominators
    `sqrt(v) + eps` and the zero-variance masks are cached and rebuilt (on the device) only when `v` changes or a
    state is loaded. After `step()` the gradients hold scratch values: their storage is reused for the update.

    Roundings: on the CPU every op rounds as DeepSpeed's (its trajectories are matched bit for bit there); on
    other devices (a GPU, and the `meta` device the step-cost count uses), and wherever `compiled` (which rounds
    its compressions otherwise anyway) or `triton`, the momentum is one `lerp` and the
    Adam update the fused AdamW form `w (1 - lr wd) - lr m / denom`: fewer passes over memory, trajectories
    within 1e-5 relative of the CPU's (5e-7 measured; see `deepspeed_roundings`).
    """

    def __init__(self, params: Any, defaults: dict[str, Any], comm: Comm | None, bucketing: str,
                 init_noop_step: bool, mask_zero_variance: bool, dense_comm_dtype: str, compiled: bool = False,
                 triton: bool | None = False, keep_tail: bool = False,
                 flat_keys: Sequence[str] = ("exp_avg_sq",)) -> None:
        super().__init__(params, defaults)
        for group in self.param_groups:  # empty tensors would give NaN scales
            group["params"] = [p for p in group["params"] if p.numel() > 0]
        self.comm = comm if comm is not None else Comm()
        self.bucketing, self.init_noop_step, self.mask_zero_variance = bucketing, init_noop_step, mask_zero_variance
        self.dense_wire_dtype = WIRE_DTYPES[dense_comm_dtype]
        self.first_real_step = 2 if init_noop_step else 1
        params = self._params()
        if not params:
            raise ValueError(f"{type(self).__name__}: no parameters with elements to optimize")
        if len({(p.device, p.dtype) for p in params}) > 1:
            raise ValueError(f"{type(self).__name__}: all parameters must share one device and dtype (its state "
                             f"lives in flat buffers); got {sorted({(str(p.device), str(p.dtype)) for p in params})}")
        device, dtype = params[0].device, params[0].dtype
        triton = use_triton(triton, device, type(self).__name__, compiled, obstacle=None if dtype == torch.float32
                            else f"takes fp32 parameters (its kernels work on fp32 buffers), not {dtype}")
        groups = [index for index, group in enumerate(self.param_groups) for _ in group["params"]]
        buckets = bucket_layout([len(g["params"]) for g in self.param_groups], bucketing)
        layout = FlatLayout.packed([p.shape for p in params], groups, buckets,
                                   padded=lambda size: padded_numel(size, self.comm.world_size))
        # each bucket's param group (that of its first tensor: only flat_scaled's one bucket holds several)
        self.bucket_groups = [groups[members[0]] for members in buckets]
        self.flat = FlatState(layout, device, dtype)
        self._state_keys = ("exp_avg", *flat_keys)
        for key in self._state_keys:
            self.flat.add(key, params, self.state)
        fused = "compiled" if compiled else "triton" if triton else None
        self.buckets = CompressedBuckets(layout, self.comm, device, dtype, keep_tail=keep_tail, fused=fused)
        # DeepSpeed's roundings where its trajectories are checked (the CPU, eager); fewer passes elsewhere
        self.deepspeed_roundings = device.type == "cpu" and fused is None
        self.compiled, self.triton = compiled, triton
        self.step_count = 0
        self._stale = {"denom": True, "zero_variance": True}  # caches of v, rebuilt after v changed
        self._zero_codes: list[Tensor] | None = None
        for p in params:
            self._init_state(self.state[p], p)

    # ------------------------------------------------------------------------------------ subclass hooks
    def _init_state(self, state: dict[str, Any], p: Tensor) -> None:
        """State that is not per element (the flat keys are already in `state`)."""

    def _step(self, t: int) -> None:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One step of the algorithm; afterwards the `.grad` tensors hold scratch (their storage is reused)."""
        loss = closure_loss(closure)
        self.step_count += 1
        if self.init_noop_step and self.step_count == 1:
            return loss  # DeepSpeed's initialisation step leaves m, v and the parameters untouched
        self._step(self.step_count)
        return loss

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _grads(self) -> list[Tensor]:
        """Every parameter's gradient, a zero tensor where there is none (all ranks communicate alike), contiguous
        (a flat piece of it is a view)."""
        grads = []
        for p in self._params():
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            grads.append(p.grad)
        return grads

    def _states(self, key: str) -> list[Tensor]:
        """Every parameter's view of flat buffer `key`."""
        return self.flat.views(key)

    def _groups(self) -> list[tuple[slice, dict[str, Any]]]:
        """(positions of the group's tensors in `_params()`, the group) per param group."""
        slices, start = [], 0
        for group in self.param_groups:
            slices.append((slice(start, start + len(group["params"])), group))
            start += len(group["params"])
        return slices

    def _average(self, tensors: Sequence[Tensor]) -> None:
        average_tensors_(tensors, self.comm, DENSE_BUCKET_NUMEL, self.dense_wire_dtype)

    def _momentum_(self, inputs: list[Tensor]) -> None:
        """`m <- beta1 m + (1 - beta1) x` for every group (`momentum_`)."""
        momenta = self._states("exp_avg")
        for slice_, group in self._groups():
            momentum_(momenta[slice_], inputs[slice_], group["betas"][0], self.deepspeed_roundings)

    def _variance_(self, grads: list[Tensor]) -> None:
        """`v <- beta2 v + (1 - beta2) g^2` for every group; the caches of `v` are stale from here on."""
        variances = self._states("exp_avg_sq")
        for slice_, group in self._groups():
            foreach_variance_(variances[slice_], grads[slice_], group["betas"][1])
        self._stale = dict.fromkeys(self._stale, True)

    def _denominators(self) -> list[Tensor]:
        """Per tensor `sqrt(v) + eps` (views of a flat buffer), rebuilt only after `v` changed.

        Frozen variance makes the denominator constant through a compressed stage: one pass instead of
        two per step. Rebuilt in place, one op per segment, so the cache costs one state-sized buffer.
        """
        if self._stale["denom"]:
            if "denom" not in self.flat:
                self.flat.add("denom")
            for (group, variance), (_, denom) in zip(self.flat.segments("exp_avg_sq"), self.flat.segments("denom"),
                                                      strict=True):
                torch.sqrt(variance, out=denom).add_(self.param_groups[group]["eps"])
            self._stale["denom"] = False
        return self.flat.views("denom")

    def _compressed_mean_(self, key: str, fed_back: bool = False, divisors: Sequence[float] | None = None) -> None:
        """Flat buffer `key`'s compressed mean over ranks (`CompressedBuckets.allreduce_`), with the elements of zero
        variance zeroed (`mask_zero_variance`): 1 bit cannot represent 0, and 1-bit noise / eps would move them.

        On several ranks the decoding zeroes them (`_zero_variance_codes`: no pass of its own); one rank decodes
        nothing, and a masked fill per segment does.
        """
        self.buckets.allreduce_(self.flat[key], fed_back, divisors, self._zero_variance_codes())
        if self.mask_zero_variance and not self.comm.distributed:
            for (_, values), (_, mask) in zip(self.flat.segments(key), self.flat.segments("zero_variance"),
                                              strict=True):
                values.masked_fill_(mask, 0.0)

    def _zero_variance_codes(self) -> list[Tensor] | None:
        """Per bucket, `zero_codes_` of the elements whose variance is 0 (None without the mask, or on one rank).

        Built on the device when `v` changed (no host read decides which tensors need one): the flags first, in a
        bool buffer; on several ranks each bucket's codes are then made in place of its flags (a quarter of their
        bytes), which the masked fill of one rank would read instead.
        """
        if not self.mask_zero_variance:
            return None
        if self._stale["zero_variance"]:
            if "zero_variance" not in self.flat:
                self.flat.add("zero_variance", dtype=torch.bool)
            flags = self.flat["zero_variance"]
            flags.zero_()  # the padding's flags clear: codes of the last build may sit there
            for (_, variance), (_, mask) in zip(self.flat.segments("exp_avg_sq"), self.flat.segments("zero_variance"),
                                                strict=True):
                torch.eq(variance, 0, out=mask)
            self._zero_codes = ([zero_codes_(bucket) for bucket in self.flat.layout.bucket_views(flags)]
                                if self.comm.distributed else None)
            self._stale["zero_variance"] = False
        return self._zero_codes

    def _mask_(self, key: str) -> None:
        """Multiply flat buffer `key` by each group's `exp_avg_mask` (DeepSpeed's momentum mask), where one is set."""
        views = self._states(key)
        for slice_, group in self._groups():
            group_mask = self._group_mask(group)
            if group_mask is None:
                continue
            for view in views[slice_]:
                view.mul_(group_mask)  # in place (DeepSpeed PR #1278)

    def _group_mask(self, group: dict[str, Any]) -> Tensor | None:
        """The group's `exp_avg_mask`, moved to the state's device once (None where the group sets none)."""
        group_mask = group.get("exp_avg_mask")
        if group_mask is not None and group_mask.device != self.flat.device:
            group["exp_avg_mask"] = group_mask = group_mask.to(self.flat.device)
        return group_mask

    def _adam_update_(self, scratch: list[Tensor]) -> None:
        """Every group's `w <- w - lr (m / (sqrt(v) + eps) + weight_decay w)`; `scratch` (dead gradients)."""
        params, exp_avgs, denoms = self._params(), self._states("exp_avg"), self._denominators()
        for slice_, group in self._groups():
            onebit_adam_update_(params[slice_], exp_avgs[slice_], denoms[slice_], scratch[slice_], lr=group["lr"],
                                weight_decay=group["weight_decay"], deepspeed_roundings=self.deepspeed_roundings)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the persistent tensors: `state` (flat buffers, error buffers) and `scratch` (bounded work)."""
        errors = self.buckets.worker_error, self.buckets.server_error
        return {"state": self.flat.nbytes() + sum(e.numel() * e.element_size() for e in errors), "scratch": 0}

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Torch's state (the flat buffers' views: nothing is copied) plus this rank's own: step counter, error
        buffers, phase and schedule state."""
        state = super().state_dict()
        state["onebit"] = {"step": self.step_count, "buckets": self.buckets.state_dict(self.flat["exp_avg"]),
                           **self._extra_state()}
        for group in state["param_groups"]:
            group.pop("exp_avg_mask", None)  # masks come from the config of every run, as in DeepSpeed
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by `state_dict()` (of this class, this model and this world size), the per-element
        state straight into the flat buffers: torch's loader would first copy every tensor to the device."""
        state_dict = dict(state_dict)
        own = state_dict.pop("onebit")
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        small, flat = pop_flat_entries(state_dict, self._state_keys)
        # torch casts floating state to the parameter's dtype; float64 scalars must come back unrounded
        exact = {index: {key: value for key, value in entry.items() if torch.is_tensor(value)
                         and value.dtype == torch.float64} for index, entry in small["state"].items()}
        super().load_state_dict(small)
        for index, p in enumerate(self._params()):
            for key, value in exact.get(index, {}).items():
                self.state[p][key] = value.to(p.device)
        for key in self._state_keys:
            self.flat.load_(key, flat[key])
            for p, view in zip(self._params(), self.flat.views(key), strict=True):
                self.state[p][key] = view
        for group, mask in zip(self.param_groups, masks, strict=True):
            group.pop("exp_avg_mask", None)
            if mask is not None:
                group["exp_avg_mask"] = mask
        self.step_count = own["step"]
        self.buckets.load_state_dict(own["buckets"], self.flat["exp_avg"])
        self._load_extra_state(own)
        self._stale = dict.fromkeys(self._stale, True)


class OneBitAdam(OneBitFamily):
    r"""1-bit Adam (Tang et al., ICML 2021, arXiv 2102.02888), with DeepSpeed 0.19.6's semantics.

    With :math:`t` counting steps including the no-op init step (:math:`t = 1`):

    - Warm-up, :math:`t \le` ``freeze_step``: :math:`\bar g` = the exact mean gradient over ranks,
      :math:`m \leftarrow \beta_1 m + (1-\beta_1)\bar g`, :math:`v \leftarrow \beta_2 v + (1-\beta_2)\bar g^2`.
    - Compression, :math:`t >` ``freeze_step`` (:math:`v` frozen for good):
      :math:`m \leftarrow C(\beta_1 m + (1-\beta_1) g_{\text{local}})`, the error-compensated 1-bit mean
      over ranks (identical on every rank), times the mask.
    - Every real step: :math:`w \leftarrow w - \eta\,(m / (\sqrt v + \epsilon) + \lambda w)`, no bias
      correction.

    Args:
        params: parameters or param groups; a group may carry ``exp_avg_mask`` (DeepSpeed's momentum mask).
        lr, betas, eps, weight_decay: as in Adam; decay is decoupled and sits inside the LR product.
        freeze_step: last step (counting the init step) of the full-precision warm-up.
        bucketing: ``per_group`` (one compressed call per param group, DeepSpeed's fused fp16 path) or
            ``per_tensor`` (one per tensor, DeepSpeed's fp32 path).
        init_noop_step: keep DeepSpeed's no-op first step (it counts toward ``freeze_step``).
        mask_zero_variance: zero communicated momentum where :math:`v = 0` (see the differences below).
        dense_comm_dtype: wire dtype of the full-precision gradient averages (warm-up): ``fp32``, or ``fp16``
            / ``bf16`` for half the bytes, as DeepSpeed's fp16 engine sends (the sum is in the wire dtype).
        compiled: the compressed all-reduce's compressions compiled by torch.compile (inductor), fewer passes
            than the aten ops (`optim.compressed.compressed_allreduce_`), on the fused roundings; the first
            compressed step compiles (a graph per bucket). Not with ``per_tensor`` bucketing.
        triton: the compressed all-reduce's passes in Triton kernels (`optim._triton_compressed`): each compression
            two passes over its vector (the norm, then the error and the packed signs, the sum never stored) and the
            decoding one, on the fused roundings. fp32 CUDA tensors (or Triton's interpreter, `TRITON_INTERPRET=1`,
            for tests). Not with ``compiled``. None: the kernels where they can run (fp32 CUDA tensors, not
            ``compiled``), the aten ops elsewhere.
        comm: the communication layer (given by `build_optimizer`); None means one process.
    """

    __doc__ = (__doc__ or "") + DIFFERENCES_FROM_DEEPSPEED

    def __init__(self, params: Any, lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100000, bucketing: str = "per_group",
                 init_noop_step: bool = True, mask_zero_variance: bool = True, dense_comm_dtype: str = "fp32",
                 compiled: bool = False, triton: bool | None = False, comm: Comm | None = None) -> None:
        run_check(type(self).__name__, check_onebit_adam_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, freeze_step=freeze_step, bucketing=bucketing,
            init_noop_step=init_noop_step, mask_zero_variance=mask_zero_variance, dense_comm_dtype=dense_comm_dtype,
            compiled=compiled, triton=triton,
        ))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.freeze_step = freeze_step
        super().__init__(params, defaults, comm, bucketing, init_noop_step, mask_zero_variance, dense_comm_dtype,
                         compiled, triton)

    def compressing(self, t: int) -> bool:
        """Whether step `t` is in the compression stage."""
        return t > max(self.freeze_step, self.first_real_step)

    def _step(self, t: int) -> None:
        grads = self._grads()
        if self.compressing(t):
            self._momentum_(grads)
            self._compressed_mean_("exp_avg")  # the momenta live in the buckets' buffer: in place
            self._mask_("exp_avg")
        else:
            self._average(grads)
            self._momentum_(grads)
            self._variance_(grads)
        self._adam_update_(grads)


def momentum_(exp_avgs: list[Tensor], inputs: list[Tensor], beta1: float, deepspeed_roundings: bool) -> None:
    """`m <- beta1 m + (1 - beta1) x`: DeepSpeed's two ops (`foreach_momentum_`) with its roundings, or one
    `lerp` (one pass fewer, rounded apart)."""
    if deepspeed_roundings:
        foreach_momentum_(exp_avgs, inputs, beta1)
    else:
        torch._foreach_lerp_(exp_avgs, inputs, 1.0 - beta1)


def onebit_adam_update_(params: list[Tensor], exp_avgs: list[Tensor], denoms: list[Tensor], scratch: list[Tensor],
                        *, lr: float, weight_decay: float, deepspeed_roundings: bool = True) -> None:
    """Functional core of the family's Adam step: `w <- w - lr (m / denom + weight_decay w)`, `denom = sqrt(v) + eps`.

    With `deepspeed_roundings` the roundings are DeepSpeed's: `m / denom` and `weight_decay * w` each rounded,
    then summed (addcdiv with value 1 adds the rounded quotient exactly), then scaled by `-lr`, then added;
    `scratch` (same shapes; the caller's dead gradients) receives the update, so nothing is allocated. Without,
    the fused AdamW form `w (1 - lr weight_decay) - lr m / denom`: two passes over the weights instead of five,
    no scratch, rounded apart.
    """
    if not params:
        return
    if not deepspeed_roundings:
        if weight_decay != 0:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        torch._foreach_addcdiv_(params, exp_avgs, denoms, value=-lr)
        return
    if weight_decay != 0:
        torch._foreach_copy_(scratch, params)
        torch._foreach_mul_(scratch, weight_decay)
    else:
        torch._foreach_zero_(scratch)
    torch._foreach_addcdiv_(scratch, exp_avgs, denoms)
    torch._foreach_mul_(scratch, -lr)
    torch._foreach_add_(params, scratch)


register_optimizer(OptimSpec(
    "onebit_adam", OneBitAdam, "self", check=check_onebit_adam_options, warmup_option="freeze_step",
    restart_refusal=ONEBIT_RESTART_REFUSAL,
    state_bytes_per_param=onebit_family_bytes(3),  # m, v, sqrt(v) + eps
    description="1-bit Adam (DeepSpeed 0.19.6 semantics): full-precision warm-up, then 1-bit compressed momentum",
))
