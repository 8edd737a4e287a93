"""LAMB with NVIDIA's NVLAMB semantics (apex `FusedLAMB`): grad-norm pre-normalisation, Adam, trust ratios."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from core.options import require
from optim._compiled import CompiledMath, device_scalars, graph_chunks
from optim._math import (
    adam_direction,
    adam_moments_,
    bias_corrections,
    closure_loss,
    fused_add_adam_direction_,
    global_grad_norm,
    grad_prenorm_divisor,
    trust_ratio,
)
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.flat import dense, foreach_chunks, same_layout
from optim.option_checks import check_adam_hyperparameters, check_flags, check_triton, use_triton


class LAMB(torch.optim.Optimizer):
    r"""Layer-wise Adaptive Moments for Batch training (You et al. 2019, arXiv 1904.00962), NVLAMB flavour.

    For each parameter tensor :math:`w` with gradient :math:`g`, at step :math:`t`:

    .. math::
        \hat g_t &= g_t / \max(1, \lVert G_t \rVert / \text{max\_grad\_norm})
            && \text{(NVLAMB: } G_t \text{ = all gradients of all groups)} \\
        m_t &= \beta_1 m_{t-1} + (1 - \beta_1) \hat g_t, \qquad
        v_t = \beta_2 v_{t-1} + (1 - \beta_2) \hat g_t^2 \\
        u_t &= \frac{m_t / (1 - \beta_1^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon} + \lambda w_{t-1} \\
        r_t &= \lVert w_{t-1} \rVert / \lVert u_t \rVert \quad (1 \text{ if either norm is } 0;
            \ \le 1 \text{ with trust\_clip}) \\
        w_t &= w_{t-1} - \eta\, r_t\, u_t

    This is Algorithm 2 of the paper with :math:`\phi` the identity, plus NVIDIA's global-norm
    pre-normalisation (NVIDIA DeepLearningExamples BERT, apex ``FusedLAMB``). As in apex
    (``use_nvlamb=False``) and timm, the trust ratio is applied only where :math:`\lambda \ne 0` unless
    ``always_adapt``; biases and LayerNorm weights (no decay) thus get plain Adam steps.

    Args:
        params: parameters or param groups (see `optim.param_groups_weight_decay`).
        lr: the learning rate :math:`\eta`.
        betas: :math:`(\beta_1, \beta_2)`.
        eps: :math:`\epsilon`, added to :math:`\sqrt{\hat v}`.
        weight_decay: :math:`\lambda`, decoupled (AdamW style): added to the update, so it is also scaled
            by the trust ratio.
        bias_correction: divide the moments by :math:`1 - \beta^t`.
        max_grad_norm: pre-normalise gradients to this global L2 norm when it is exceeded; None turns it off
            (use None when the trainer already clips to the same norm: that is the same operation).
            Optimizer-wide, because the norm spans all groups.
        trust_clip: clamp the trust ratio to at most 1 (timm's LAMBC option).
        always_adapt: apply the trust ratio also where weight_decay is 0 (apex ``use_nvlamb=True``).
        foreach: use the multi-tensor path (torch's fused Adam kernel for the moments and the direction,
            foreach kernels for the norms and the update: a fixed number of ops per chunk); None picks it
            when a group's tensors share device and dtype, False takes the for-loop reference. It runs over
            chunks of a bounded number of elements (see `optim._math.FOREACH_CHUNK_NUMEL`) and rounds apart
            from the reference within a few units in the last place per step.
        triton: run the multi-tensor path's trust-ratio tensors in three Triton kernels per chunk
            (`optim._triton_lamb`): the moments and each block's sums for the norms, the ratios, the update formed
            again and applied. 10 tensor-sized reads and writes in 3 launches, however many tensors (the aten ops: 14,
            and a launch per tensor for the ratios). CUDA tensors only (or Triton's interpreter, `TRITON_INTERPRET=1`,
            for tests); the update rounds apart from the aten ops' within 1e-5 relative (other orders of the norms'
            sums). Needs `foreach` true or null, and not `compiled`. None: the kernels where they can run (CUDA
            tensors of one device and dtype, not `compiled`), the aten ops elsewhere.
        compiled: run the multi-tensor path's decayed tensors in two passes compiled by torch.compile (inductor):
            one writes the moments and reduces the norms of the weights and the update, the other forms the
            update again and writes the weights (10 tensor-sized reads and writes where the aten ops take 14).
            Each chunk compiles in the first step; the update rounds apart from the aten ops' within 1e-5 relative
            (inductor orders the norms' sums otherwise). Needs `foreach` true or null.

    The step :math:`t` of the bias corrections is counted per param group, as in apex ``FusedLAMB``:
    ``group["step"]`` (a Python int, so reading it is no device sync) goes up by one at every `step()` call,
    for every group, whichever of its parameters have gradients. A parameter without a gradient is skipped
    (its moments are left alone); when it next gets one, its moments are corrected with the group's
    :math:`t`, not with the number of updates it has received itself.

    State per parameter: ``exp_avg`` (:math:`m`), ``exp_avg_sq`` (:math:`v`) and ``step``, the number of
    updates this tensor has received, a Python int: bookkeeping only, which the update never reads. (Counted in
    0-d CPU tensors, as `torch.optim.Adam` does, it took a host op per tensor per step, about 1 ms of a BERT-Large
    step that a GPU waits for; `load_state_dict` turns such saved counts into ints.) `state_dict()` holds all of
    these and, in its ``param_groups``, each group's ``step``, so a resumed run continues exactly.

    Checkpoints of the earlier LAMB, which counted :math:`t` per parameter, have no group ``step``:
    `load_state_dict` sets it to the largest per-parameter ``step`` of the group (the number of `step()`
    calls whenever some tensor of the group had a gradient at each of them, as is usual). A group none of
    whose tensors has state is left without one and counts from 1, as a fresh group does.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_grad_norm: float | None = 1.0,
        trust_clip: bool = False,
        always_adapt: bool = False,
        foreach: bool | None = None,
        compiled: bool = False,
        triton: bool | None = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            trust_clip=trust_clip,
            always_adapt=always_adapt,
            foreach=foreach,
            compiled=compiled,
            triton=triton,
        )
        run_check("LAMB", check_lamb_options, defaults)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["max_grad_norm"] != max_grad_norm:
                raise ValueError(
                    f"LAMB: max_grad_norm={group['max_grad_norm']} in a param group; it is optimizer-wide "
                    f"(the norm spans all groups), pass it to the constructor"
                )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # options added after a checkpoint was written
            group.setdefault("trust_clip", False)
            group.setdefault("always_adapt", False)
            group.setdefault("foreach", None)
            group.setdefault("compiled", False)
            group.setdefault("triton", False)
            counted = [self.state[p] for p in group["params"] if "step" in self.state.get(p, {})]
            for entry in counted:  # saved as 0-d tensors before the counts were ints
                entry["step"] = int(entry["step"])
            if "step" not in group and counted:  # written when t was counted per parameter: see the class docstring
                group["step"] = max(entry["step"] for entry in counted)

    def _init_group(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        """The group's tensors that have gradients, creating their state on first use and counting this update."""
        params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            state["step"] += 1
        return params, grads, exp_avgs, exp_avg_sqs

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update of every parameter that has a gradient; `p.grad` is left unchanged."""
        loss = closure_loss(closure)

        grad_divisor = None
        max_grad_norm = self.defaults["max_grad_norm"]
        if max_grad_norm is not None:
            all_grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if all_grads:
                grad_divisor = grad_prenorm_divisor(global_grad_norm(all_grads), max_grad_norm)

        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # apex: once per call, for every group
            params, grads, exp_avgs, exp_avg_sqs = self._init_group(group)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            lamb(
                params, grads, exp_avgs, exp_avg_sqs,
                step=group["step"],
                grad_divisor=grad_divisor,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                bias_correction=group["bias_correction"],
                trust_clip=group["trust_clip"],
                always_adapt=group["always_adapt"],
                foreach=group["foreach"],
                compiled=group["compiled"],
                triton=group["triton"],
            )
        return loss


def lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    grad_divisor: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_clip: bool,
    always_adapt: bool,
    foreach: bool | None = None,
    compiled: bool = False,
    triton: bool | None = False,
) -> None:
    """Functional LAMB over one param group (see `LAMB`); `grad_divisor` is NVLAMB's pre-normalisation.

    `step` is the group's 1-based step count, which every bias correction uses (apex `FusedLAMB`).
    """
    if not params:
        return
    uniform = same_layout(params, grads, exp_avgs, exp_avg_sqs)
    if foreach and not uniform:
        raise ValueError("LAMB(foreach=True) needs each group's tensors on one device and dtype, with gradients laid "
                         "out as their parameters; try None")
    if compiled and not uniform:
        raise ValueError("LAMB(compiled=True) runs the multi-tensor path, which needs each group's tensors on one "
                         "device and dtype, with gradients laid out as their parameters; set compiled=False")
    triton = use_triton(triton, params[0].device, "LAMB", compiled, obstacle=None if uniform else (
        "needs each group's tensors on one device and dtype, with gradients laid out as their parameters"))
    options = dict(
        grad_divisor=grad_divisor,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        max_ratio=1.0 if trust_clip else None,
        adapt=weight_decay != 0 or always_adapt,
    )
    if not (uniform if foreach is None else foreach):
        corrections = bias_corrections(step, beta1, beta2, bias_correction)
        _single_tensor_lamb(params, grads, exp_avgs, exp_avg_sqs, corrections=corrections, **options)
        return
    for chunk in foreach_chunks(params):
        _multi_tensor_lamb(
            params[chunk], grads[chunk], exp_avgs[chunk], exp_avg_sqs[chunk],
            step=step, bias_correction=bias_correction, compiled=compiled, triton=triton, **options,
        )


def check_lamb_options(options: dict[str, Any]) -> None:
    """LAMB's value checks, run by its constructor and, through the registry, on the config before any worker."""
    check_adam_hyperparameters(options)
    max_grad_norm = options["max_grad_norm"]
    require(max_grad_norm is None or max_grad_norm > 0.0, "max_grad_norm", max_grad_norm,
            "must be positive, or null (off)")
    check_flags(options, "bias_correction", "trust_clip", "always_adapt")
    foreach = options["foreach"]
    require(foreach is None or isinstance(foreach, bool), "foreach", foreach, "must be true, false or null (auto)")
    check_flags(options, "compiled")
    require(not (options["compiled"] and foreach is False), "compiled", True,
            "needs the multi-tensor path: set foreach to true or null, or compiled to false")
    check_triton(options)
    require(not (options["triton"] and foreach is False), "triton", True,
            "needs the multi-tensor path: set foreach to true or null, or triton to false")


def _single_tensor_lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    grad_divisor: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    corrections: tuple[float, float],
    max_ratio: float | None,
    adapt: bool,
) -> None:
    """The reference: one tensor at a time, in the order of the update rule."""
    bias_correction1, bias_correction2 = corrections  # the group's: one step count for all its tensors
    for p, grad, exp_avg, exp_avg_sq in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if grad_divisor is not None:
            grad = grad / grad_divisor  # a new tensor: p.grad stays as the caller left it
        adam_moments_(exp_avg, exp_avg_sq, grad, beta1, beta2)
        update = adam_direction(exp_avg, exp_avg_sq, bias_correction1, math.sqrt(bias_correction2), eps)
        if weight_decay != 0:
            update.add_(p, alpha=weight_decay)
        if adapt:
            update.mul_(trust_ratio(torch.linalg.vector_norm(p), torch.linalg.vector_norm(update), max_ratio))
        p.add_(update, alpha=-lr)


def _multi_tensor_lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    grad_divisor: Tensor | None,
    lr: float,
    compiled: bool,
    triton: bool,
    **update: Any,
) -> None:
    """NVLAMB's pre-normalisation, then `lamb_update_` (a fixed number of ops per chunk), or, for
    trust-ratio tensors, `compiled_lamb_update_` (`compiled`) or the Triton kernels (`triton`, dense tensors), with
    the pre-normalisation in their first pass."""
    if triton and update["adapt"] and all(dense(p) for p in params):
        from optim._triton_lamb import triton_lamb_update_  # imports triton: only where `triton_refusal` allowed it

        corrections = bias_corrections(update.pop("step"), update["beta1"], update["beta2"],
                                       update.pop("bias_correction"))
        update.pop("adapt")
        triton_lamb_update_(params, grads, exp_avgs, exp_avg_sqs, grad_divisor=grad_divisor, lr=lr,
                            corrections=corrections, **update)
        return
    if compiled and update["adapt"]:
        compiled_lamb_update_(params, grads, exp_avgs, exp_avg_sqs, grad_divisor=grad_divisor, lr=lr, **update)
        return
    if grad_divisor is not None:
        grads = torch._foreach_div(grads, grad_divisor)  # new tensors: p.grad stays as the caller left it
    lamb_update_(params, grads, exp_avgs, exp_avg_sqs, lr=lr, **update)


def lamb_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    lr: float | Sequence[float],
    step: int,
    bias_correction: bool,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_ratio: float | None,
    adapt: bool,
) -> None:
    """LAMB's multi-tensor update of one chunk of one device and dtype: one fused Adam pass and three foreach
    passes. `lr` is the group's, or one per tensor (JointSpar's `lr / p` of each tensor's layer).

    Memory passes, in tensor-sized reads and writes: the update `u = wd * w` (2), the fused Adam kernel that
    moves the moments and adds the direction to `u` (7: reads g, m, v, u; writes m, v, u), the norms of `w` and
    `u` (2) and `w -= lr * ratio * u` (3): 14, twice the 7 of one fused pass. A tensor without the trust
    ratio takes a plain Adam step in the fused kernel alone (7), or, with an LR per tensor, the direction scaled
    by it in two more passes.
    """
    adam = dict(step=step, beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction)
    per_tensor = not isinstance(lr, (int, float))
    if not adapt and not per_tensor:  # plain Adam step: w -= lr * direction, in the one kernel
        fused_add_adam_direction_(params, grads, exp_avgs, exp_avg_sqs, scale=-lr, **adam)
        return
    updates = torch._foreach_mul(params, weight_decay)  # u = wd * w + direction
    fused_add_adam_direction_(updates, grads, exp_avgs, exp_avg_sqs, scale=1.0, **adam)
    del grads
    steps = [-rate for rate in lr] if per_tensor else None
    if not adapt:  # a plain Adam step at each tensor's LR
        torch._foreach_mul_(updates, steps)
        torch._foreach_add_(params, updates)
        return
    ratios = trust_ratio(torch.stack(torch._foreach_norm(params)), torch.stack(torch._foreach_norm(updates)),
                         max_ratio)
    # Per-tensor 0-d factors have no foreach fast path; addcmul applies ratio and lr in the one pass left.
    factors = torch._foreach_mul(list(ratios.unbind()), steps) if per_tensor else list((ratios * -lr).unbind())
    torch._foreach_addcmul_(params, updates, factors)


def compiled_lamb_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    grad_divisor: Tensor | None,
    lr: float,
    step: int,
    bias_correction: bool,
    adapt: bool,
    **constants: Any,
) -> None:
    """`lamb_update_` of trust-ratio tensors (`adapt`) in two compiled passes over a chunk: 10 tensor-sized reads
    and writes, the least a trust ratio allows (its norms need the whole update before any weight changes).

    The first pass reads g, m, v and w, writes m and v and reduces the norms (6); the second reads w, m and v and
    writes w (4), forming the update again rather than storing it.
    """
    # The corrections are formed on the host and enter as 0-d tensors (values, not the step count): inductor's CPU
    # loop computed beta ** t in double precision for every 8 elements it formed from them.
    bias_correction1, bias_correction2 = bias_corrections(step, constants["beta1"], constants["beta2"], bias_correction)
    *corrections, rate = device_scalars(params[0].device, bias_correction1, math.sqrt(bias_correction2), lr)
    max_ratio = constants.pop("max_ratio")
    for run in graph_chunks(params):
        ratios = _LAMB_MOMENTS_AND_RATIOS(params[run], grads[run], exp_avgs[run], exp_avg_sqs[run], grad_divisor,
                                          *corrections, max_ratio=max_ratio, **constants)
        _LAMB_APPLY(params[run], exp_avgs[run], exp_avg_sqs[run], ratios, rate, *corrections, **constants)


def _lamb_direction(w: Tensor, m: Tensor, v: Tensor, bias_correction1: Tensor, root_correction2: Tensor, eps: float,
                    weight_decay: float) -> Tensor:
    """LAMB's update `u` as `_single_tensor_lamb` forms it, from the corrections `1 - beta1**t` and
    `sqrt(1 - beta2**t)` (0-d tensors)."""
    update = adam_direction(m, v, bias_correction1, root_correction2, eps)
    return update.add_(w, alpha=weight_decay) if weight_decay != 0 else update


def _lamb_moments_and_ratios(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                             exp_avg_sqs: list[Tensor], grad_divisor: Tensor | None, bias_correction1: Tensor,
                             root_correction2: Tensor, *, max_ratio: float | None, **constants: float) -> Tensor:
    """First pass: the moments written, each tensor's trust ratio from the norms of its weights and update."""
    weight_norms, update_norms = [], []
    for w, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if grad_divisor is not None:
            g = g / grad_divisor
        adam_moments_(m, v, g, constants["beta1"], constants["beta2"])
        weight_norms.append(torch.linalg.vector_norm(w))
        update = _lamb_direction(w, m, v, bias_correction1, root_correction2, constants["eps"],
                                 constants["weight_decay"])
        update_norms.append(torch.linalg.vector_norm(update))
    return trust_ratio(torch.stack(weight_norms), torch.stack(update_norms), max_ratio)


def _lamb_apply(params: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], ratios: Tensor,
                lr: Tensor, bias_correction1: Tensor, root_correction2: Tensor, **constants: float) -> None:
    """Second pass: `w -= lr * ratio * u`, the update formed again from the moments the first pass wrote."""
    for w, m, v, ratio in zip(params, exp_avgs, exp_avg_sqs, ratios.unbind(), strict=True):
        update = _lamb_direction(w, m, v, bias_correction1, root_correction2, constants["eps"],
                                 constants["weight_decay"])
        w.sub_(update.mul_(ratio * lr))


# Store each new moment once and let the norms read it in the same loop: by default inductor recomputes the moments
# (read twice) in the norms' loop and in another loop that writes them back, 9 reads and writes instead of 6.
_LAMB_MOMENTS_AND_RATIOS = CompiledMath(_lamb_moments_and_ratios, options={"realize_reads_threshold": 1})
_LAMB_APPLY = CompiledMath(_lamb_apply)


register_optimizer(OptimSpec(
    "lamb", LAMB, "ddp", check=check_lamb_options, state_bytes_per_param=8.0,  # m, v
    description="NVLAMB (apex FusedLAMB semantics): global grad-norm pre-normalisation, Adam, trust ratio",
))
