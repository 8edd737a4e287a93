"""O2 precision: a bf16/fp16 copy of the model runs forward and backward, while the fp32 model stays the master copy
that the optimizer steps and that checkpoints, exports, EMA and replica averaging read.

Under autocast every matmul converts its fp32 weight and activations to half precision and back, and LayerNorm, GELU,
dropout and the residual adds run in fp32 between them; with half weights and activations those conversions go, and
what needs fp32 still gets it from PyTorch's kernels (LayerNorm's statistics, softmax and SDPA accumulate in fp32)
and from the tasks (every loss is taken on `.float()` logits). The optimizer's arithmetic stays in fp32: each step
the half gradients are converted into the masters' `.grad`, and after the step the masters are copied back.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from optim.flat import FlatLayout, FlatState


class HalfCopy:
    """A copy of `masters` in `dtype` whose parameters are views of one flat buffer, and the two conversions.

    `module` shares the masters' structure (tied weights stay tied) and converts floating inputs to `dtype` as
    they enter it (an image batch). Its parameters' gradients become the masters' in `grads_to_masters_`, fp32
    views of one flat buffer as well; `pull_` copies the masters into the half weights. Each conversion is one
    foreach copy over all tensors, whatever their number.
    """

    def __init__(self, masters: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.masters = list(masters.parameters())
        device = self.masters[0].device
        layout = FlatLayout.packed([p.shape for p in self.masters], [0] * len(self.masters))
        self._weights = FlatState(layout, device, dtype)
        self._weights.add("weight")
        self._grads = FlatState(layout, device, torch.float32)  # the masters' gradients, kept across steps
        self._grads.add("grad")
        # deepcopy with every master mapped to its half parameter: no fp32 copy is made, and ties are kept.
        halves = {id(m): nn.Parameter(view, requires_grad=m.requires_grad)
                  for m, view in zip(self.masters, self._weights.views("weight"), strict=True)}
        self.module = copy.deepcopy(masters, memo=halves)
        for name, buffer in list(self.module.named_buffers()):  # floating ones (attention masks) in dtype too
            if buffer.is_floating_point():
                owner, _, attribute = name.rpartition(".")
                setattr(self.module.get_submodule(owner), attribute, buffer.to(dtype))
        self.params = list(self.module.parameters())
        self.module.register_forward_pre_hook(self._inputs_to_half, with_kwargs=True)
        self.pull_()

    @torch.no_grad()
    def pull_(self) -> None:
        """The masters' values into the half weights (after an optimizer step, or a checkpoint was loaded)."""
        torch._foreach_copy_(self._weights.views("weight"), [m.detach() for m in self.masters])

    @torch.no_grad()
    def grads_to_masters_(self) -> None:
        """Each half gradient into its master's `.grad` in fp32, and the half gradients dropped. A parameter with
        no half gradient (unused, or a layer JointSpar did not sample) keeps no master gradient either."""
        masters, views, grads = [], [], []
        for master, view, half in zip(self.masters, self._grads.views("grad"), self.params, strict=True):
            if half.grad is not None:
                masters.append(master)
                views.append(view)
                grads.append(half.grad)
        if grads:
            torch._foreach_copy_(views, grads)
        for master, view in zip(masters, views, strict=True):
            master.grad = view
        self.zero_grad()

    def zero_grad(self) -> None:
        """Drop the half gradients (a step abandoned between micro-batches)."""
        for half in self.params:
            half.grad = None

    def follow_trainable(self) -> None:
        """Let exactly the half parameters whose masters require gradients compute them (JointSpar switches the
        masters' `requires_grad` to sample layers)."""
        for master, half in zip(self.masters, self.params, strict=True):
            half.requires_grad_(master.requires_grad)

    def nbytes(self) -> int:
        """What O2 adds to autocast's memory, in bytes, for the weights and again for their gradients: the half
        copy's (the masters' fp32 gradients are autocast's, here in one flat buffer)."""
        return self._weights.nbytes()

    def _inputs_to_half(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Floating inputs in the weights' dtype (integer ids and masks pass as they are)."""
        def cast(value: Any) -> Any:
            return value.to(self.dtype) if isinstance(value, Tensor) and value.is_floating_point() else value

        return tuple(cast(a) for a in args), {key: cast(value) for key, value in kwargs.items()}
