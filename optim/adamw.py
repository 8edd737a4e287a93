"""`torch.optim.AdamW`, registered as `adamw`: the decoupled-weight-decay Adam baseline, in torch's fused kernel or,
with `triton`, in a Triton kernel of the same math (`optim._triton_adamw`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from core.options import require
from optim._math import closure_loss
from optim._registry import OptimSpec, register_optimizer
from optim.flat import dense, foreach_chunks, same_layout
from optim.option_checks import check_adam_hyperparameters, check_triton, use_triton

# AdamW's options that the Triton kernel does not take, with the value it needs
_KERNEL_NEEDS = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYOUT_OBSTACLE = ("needs each group's tensors on one device and dtype, dense, with gradients and moments laid out as "
                    "their parameters")


class AdamW(torch.optim.AdamW):
    """torch's AdamW whose step may run in a Triton kernel (`triton`): one pass over w, g, m and v per chunk of
    tensors, where torch's fused kernel, which moves the same bytes, took 1.30x a copy's time on one H100.

    `triton`: True takes the kernel (or a ValueError names why it cannot run), None takes it on the CUDA tensors of
    an A100, H100 or newer GPU and torch's step elsewhere, False keeps torch's step. The kernel needs each param
    group's tensors on one device and dtype (fp32, bf16 or fp16), each parameter dense (contiguous, or transposed)
    with its gradient and moments laid out as it is, and none of `amsgrad`, `maximize`, `capturable`,
    `differentiable`; where one group falls short, torch steps every group (with `triton=True`, a ValueError says
    why).
    The state is torch's (a 0-d float32 step count per parameter on its device, as for torch's fused kernel), so a
    checkpoint resumes on either path; the weights agree with torch's fused step within 1e-5 relative.
    """

    def __init__(self, params: Any, *, triton: bool | None = False, **options: Any) -> None:
        super().__init__(params, **options)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        self.triton = first is not None and use_triton(triton, first.device, "AdamW", obstacle=self._option_obstacle())
        self._asked = triton is True  # a step the kernel cannot take is then an error, not torch's step
        self._states_unchecked = False  # True after a load or torch's step: their state is checked once

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every parameter that has a gradient: in the kernel where `triton` took it and the
        tensors allow, else torch's."""
        stepped = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        obstacle = (self._option_obstacle() or self._tensor_obstacle(stepped)) if self.triton else None
        if obstacle is not None and self._asked:
            raise ValueError(f"AdamW(triton=True) {obstacle}; set triton=False")
        if not self.triton or obstacle is not None or not any(stepped):
            self._states_unchecked = True  # torch's non-fused step, for one, keeps its new counts on the host
            return super().step(closure)
        loss = closure_loss(closure)
        from optim._triton_adamw import triton_adamw_  # imports triton: only where `triton_refusal` allowed it

        for group, params in zip(self.param_groups, stepped, strict=True):
            states = [self._state(p) for p in params]
            tensors = ([p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                       [s["step"] for s in states])
            beta1, beta2 = group["betas"]
            for chunk in foreach_chunks(params):
                triton_adamw_(params[chunk], *(t[chunk] for t in tensors), lr=group["lr"], beta1=beta1, beta2=beta2,
                              eps=group["eps"], weight_decay=group["weight_decay"])
        return loss

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        """`p`'s state, created on first use as torch's fused step creates it."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _option_obstacle(self) -> str | None:
        """Which of the groups' options the kernel does not take (`use_triton`'s obstacle), or None."""
        for key, needed in _KERNEL_NEEDS.items():
            if any(group[key] != needed for group in self.param_groups):
                return f"does not take {key}={not needed}"
        if any(group["foreach"] for group in self.param_groups):
            return "does not take foreach=True"
        if any(isinstance(group["lr"], Tensor) for group in self.param_groups):
            return "takes the learning rate as a number, not a tensor"
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._states_unchecked = True

    def _tensor_obstacle(self, stepped: list[list[Tensor]]) -> str | None:
        """Why the kernel cannot step the groups' parameters `stepped`, or None. The gradients are checked every
        step; the moments and counts once after a load or a step of torch's, the only ways to state that `_state`
        did not make in its parameter's layout: 0.43x the host time of checking all four lists every step (0.37
        against 0.85 ms at BERT-Large, on meta tensors, where the step took about 2.5)."""
        for params in stepped:
            if not params:
                continue
            grads = [p.grad for p in params]
            if params[0].dtype not in _KERNEL_DTYPES or any(g.is_sparse for g in grads):
                return "takes dense fp32, bf16 or fp16 gradients"
            if not same_layout(params, grads) or not all(dense(p) for p in params):
                return _LAYOUT_OBSTACLE
        if self._states_unchecked:
            obstacle = self._state_obstacle()
            if obstacle is not None:
                return obstacle
            self._states_unchecked = False
        return None

    def _state_obstacle(self) -> str | None:
        """Why the kernel cannot step the moments and counts the groups hold, or None."""
        for group in self.param_groups:
            params = [p for p in group["params"] if self.state.get(p)]
            if not params:
                continue
            states = [self.state[p] for p in params]
            if not same_layout(params, *([s[key] for s in states] for key in ("exp_avg", "exp_avg_sq"))):
                return _LAYOUT_OBSTACLE
            device = params[0].device
            if not all(s["step"].device == device and s["step"].dtype == torch.float32 for s in states):
                return "needs the step counts on the parameters' device in float32 (torch's fused layout)"
        return None


def adamw(params: Any, triton: bool | None = False, **options: Any) -> AdamW:
    """`AdamW(params, triton=triton, **options)` (torch's AdamW with its `triton` switch), with `fused=True` unless the
    options choose `fused` or `foreach` (or `differentiable`), when torch has its fused kernel for every parameter
    (floating point, on the CPU or a GPU; not on the meta device).

    The fused kernel steps a whole param group in one pass, reading and writing each element once; torch's
    default takes one kernel per operation (and per tensor, on the CPU). It rounds apart from those within a
    few units in the last place per step. A checkpoint keeps the `fused` it was written with, so a run resumes
    on the path it started on.

    The fused step could also take the loss scaler's overflow check (`_step_supports_amp_scaling`): it would then
    run on every step and skip inside the kernel, where the trainer could not count the skip. Turned off, the
    scaler decides and skips the step itself, as for every other optimizer.
    """
    params = [dict(item, params=_listed(item["params"])) if isinstance(item, dict) else item for item in params]
    if options.get("fused") is None and not options.get("foreach") and not options.get("differentiable"):
        options["fused"] = _fused_kernel_covers(params)
    optimizer = AdamW(params, triton=triton, **options)
    optimizer._step_supports_amp_scaling = False
    return optimizer


_TORCH_OPTIONS = inspect.signature(torch.optim.AdamW)
adamw.__signature__ = _TORCH_OPTIONS.replace(parameters=[  # its options are AdamW's and `triton`, checked against this
    *_TORCH_OPTIONS.parameters.values(),
    inspect.Parameter("triton", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=bool | None)])


def _listed(params: Any) -> list[Any]:
    """A param group's `params` as torch reads them (a tensor or an iterable), in a list that can be read twice."""
    return [params] if isinstance(params, torch.Tensor) else list(params)


def _fused_kernel_covers(params: list[Any]) -> bool:
    """Whether torch's fused AdamW runs on every tensor of `params` (tensors, named tensors or param groups)."""
    items = [t for item in params for t in (item["params"] if isinstance(item, dict) else [item])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in items]
    devices = _get_fused_kernels_supported_devices()
    return all(t.is_floating_point() and t.device.type in devices for t in tensors)


def check_adamw_options(options: dict[str, Any]) -> None:
    """AdamW's value checks (torch's constructor checks the Adam ones too), before any worker: `triton` true is
    refused with an option its kernel does not take, or with `fused` or `foreach`, the other ways to step."""
    check_adam_hyperparameters(options)
    check_triton(options)
    if options["triton"]:
        for key, needed in _KERNEL_NEEDS.items():
            require(bool(options[key]) == needed, "triton", True,
                    f"does not take {key}={options[key]}: set triton to false or null")
        for key in ("fused", "foreach"):
            require(not options[key], "triton", True, f"and {key} are two ways to step: choose one")


register_optimizer(OptimSpec(
    "adamw", adamw, "ddp", check=check_adamw_options,
    state_bytes_per_param=lambda options, world_size: 12.0 if options["amsgrad"] else 8.0,  # m, v (, max v)
    description="torch.optim.AdamW (Loshchilov & Hutter, arXiv 1711.05101): Adam with decoupled weight decay",
))
