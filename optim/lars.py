"""LARS (You, Gitman, Ginsburg 2017): SGD with momentum whose step is scaled per tensor by a trust ratio."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from core.options import check_non_negative, check_positive, require
from optim._math import closure_loss
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.flat import foreach_chunks
from optim.option_checks import check_flags


class LARS(torch.optim.Optimizer):
    r"""Layer-wise Adaptive Rate Scaling (You, Gitman, Ginsburg, arXiv 1708.03888, eq. 6 and Algorithm 1).

    For each parameter tensor :math:`w` with gradient :math:`g` (after the trainer's clipping), in a param
    group with learning rate :math:`\gamma` and weight decay :math:`\lambda`:

    .. math::
        r &= \frac{\eta \lVert w \rVert}{\lVert g \rVert + \lambda \lVert w \rVert + \epsilon}
            \quad (1 \text{ where } \lVert w \rVert = 0 \text{ or } \lVert g \rVert = 0) \\
        d &= r\,(g + \lambda w) \\
        b &\leftarrow \mu b + d \quad (b = d \text{ at a tensor's first step}) \\
        w &\leftarrow w - \gamma\,(d + \mu b \text{ if nesterov, else } b)

    :math:`r` is the paper's local LR over the global one (its :math:`\eta` is the trust coefficient, its
    :math:`\beta` our :math:`\lambda`); :math:`\epsilon` only guards the division. This is the common
    "LR outside the momentum" variant (timm's ``Lars``, apex's LARC in scale mode over ``torch.optim.SGD``):
    Algorithm 1 of the paper accumulates :math:`\gamma r (g + \lambda w)` in the buffer instead. The two
    coincide while :math:`\gamma` is constant; here a schedule's change of :math:`\gamma` acts at once and the
    buffer stays in gradient units, as SGD's does.

    Exclusion, by shape and explicit: with ``exclude_1d`` (the default) a 1-D tensor (bias, norm scale or
    shift) gets :math:`d = g`, a plain momentum-SGD step with neither trust ratio nor weight decay, whatever
    its group says, as common LARS recipes skip biases and batch-norm parameters. The no-decay param group
    of `optim.param_groups_weight_decay` already gives such tensors :math:`\lambda = 0`; its 2-D members
    (Swin's relative-position tables) keep their trust ratio, with :math:`\lambda = 0`.

    Args:
        params: parameters or param groups; every option below is honoured per group.
        lr: the global learning rate :math:`\gamma`, set each step by the trainer's schedule.
        momentum: :math:`\mu`; 0 keeps no buffer.
        weight_decay: :math:`\lambda`, an L2 term added to the gradient inside the trust ratio (coupled, as in
            the paper).
        trust_coefficient: :math:`\eta`, 0.001 in the paper.
        eps: :math:`\epsilon` in the ratio's denominator.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        exclude_1d: 1-D tensors skip the trust ratio and weight decay.

    State per parameter: ``momentum_buffer`` (:math:`b`, created at its first step); `state_dict()` holds it.
    The step reads nothing on the host: the ratios stay on the device.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1.0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        exclude_1d: bool = True,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust_coefficient=trust_coefficient,
                        eps=eps, nesterov=nesterov, exclude_1d=exclude_1d)
        run_check("LARS", check_lars_options, defaults)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS update of every parameter that has a gradient; `p.grad` is left unchanged."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("LARS does not support sparse gradients")
            buffers = [self._momentum_buffer(p) for p in params] if group["momentum"] != 0 else None
            adapt = [p.dim() > 1 or not group["exclude_1d"] for p in params]
            # Every quantity is per tensor: in chunks of the device's FOREACH_CHUNK_NUMEL, the temporaries are
            # one chunk's, not the group's.
            for chunk in foreach_chunks(params):
                lars(
                    params[chunk], [p.grad for p in params[chunk]], None if buffers is None else buffers[chunk],
                    adapt=adapt[chunk],
                    lr=group["lr"],
                    momentum=group["momentum"],
                    weight_decay=group["weight_decay"],
                    trust_coefficient=group["trust_coefficient"],
                    eps=group["eps"],
                    nesterov=group["nesterov"],
                )
        return loss

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:  # zeros: mu * 0 + d is exactly d, the first step's buffer
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


def lars(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor] | None,
    *,
    adapt: list[bool],
    lr: float,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
    direction_scales: list[float] | None = None,
) -> None:
    """Functional LARS over tensors of one param group (see `LARS`); `adapt[i]`: tensor i gets the trust ratio and
    weight decay. `direction_scales[i]` multiplies tensor i's :math:`d` before the momentum (JointSpar's 1/p of its
    layer). `grads` are read, never written. Its temporaries (the directions) are as large as the tensors given.

    A fixed number of kernels: foreach kernels form the directions, torch's fused SGD kernel applies momentum and
    step (on a device that has it: the CPU or a GPU). Memory passes of an adapted tensor, in tensor-sized reads
    and writes: the two norms (2), `g + lambda w` (3), times the ratio (2), the fused step (5: reads w, d, b;
    writes w, b): 12, against the 5 of one fused pass; a plain tensor takes the fused step alone (5).
    """
    order = [i for i, a in enumerate(adapt) if a] + [i for i, a in enumerate(adapt) if not a]
    n_adapted = sum(adapt)
    params = [params[i] for i in order]
    # The fused kernel pairs elements by their place in memory: a gradient laid out otherwise than its parameter (a
    # hand-set contiguous gradient of a channels_last weight) is copied into the parameter's layout first.
    grads = [grads[i] if grads[i].stride() == p.stride() else torch.empty_like(p).copy_(grads[i])
             for i, p in zip(order, params, strict=True)]
    if momentum_buffers is not None:
        momentum_buffers = [momentum_buffers[i] for i in order]
    scales = None if direction_scales is None else [direction_scales[i] for i in order]

    # JointSpar's factors ride on the trust ratios (0-d) where there are ratios; plain directions are gradients.
    adapted = _trust_ratio_directions(params[:n_adapted], grads[:n_adapted], weight_decay, trust_coefficient, eps,
                                      None if scales is None else scales[:n_adapted])
    plain = grads[n_adapted:]  # the gradients themselves, only read below
    if scales is not None and plain:
        plain = torch._foreach_mul(plain, scales[n_adapted:])
    # b = mu b + d, then w -= lr (d + mu b if nesterov, else b), in one pass of torch's fused SGD kernel; the
    # buffers start at zero, so the first step's mu * 0 + d is exactly d.
    torch._fused_sgd_(params, [*adapted, *plain], [] if momentum_buffers is None else momentum_buffers,
                      weight_decay=0.0, momentum=momentum, lr=lr, dampening=0.0, nesterov=nesterov, maximize=False,
                      is_first_step=False)


def _trust_ratio_directions(
    params: list[Tensor], grads: list[Tensor], weight_decay: float, trust_coefficient: float, eps: float,
    scales: list[float] | None = None,
) -> list[Tensor]:
    """`scale * r * (g + lambda w)` per tensor, as new tensors, with the ratios kept on the device (no host read)."""
    if not params:
        return []
    weight_norms = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
    grad_norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    ratios = trust_coefficient * weight_norms / (grad_norms + weight_decay * weight_norms + eps)
    ratios = list(torch.where((weight_norms > 0) & (grad_norms > 0), ratios, torch.ones_like(ratios)).unbind())
    if scales is not None:
        ratios = torch._foreach_mul(ratios, scales)
    if weight_decay == 0:
        return torch._foreach_mul(grads, ratios)
    directions = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_mul_(directions, ratios)
    return directions


def check_lars_options(options: dict[str, Any]) -> None:
    """LARS's value checks, run by its constructor and, through the registry, on the config before any worker."""
    check_non_negative("lr", options["lr"])
    momentum = options["momentum"]
    require(isinstance(momentum, int | float) and 0.0 <= momentum < 1.0, "momentum", momentum, "must be in [0, 1)")
    check_non_negative("weight_decay", options["weight_decay"])
    check_positive("trust_coefficient", options["trust_coefficient"])
    check_non_negative("eps", options["eps"])
    check_flags(options, "nesterov", "exclude_1d")
    require(not options["nesterov"] or momentum > 0, "nesterov", options["nesterov"], "needs momentum > 0")


register_optimizer(OptimSpec(
    "lars", LARS, "ddp", check=check_lars_options,
    state_bytes_per_param=lambda options, world_size: 4.0 if options["momentum"] else 0.0,  # momentum buffer
    description="LARS (You et al., arXiv 1708.03888): momentum SGD with a per-tensor trust ratio; 1-D tensors "
                "excluded",
))
