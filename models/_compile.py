"""torch.compile for training (`trainer.compile`, the throughput benchmark's `--compile`).

A model whose builder names its repeated blocks (`ModelSpec.compile_regions`) has each of them compiled on its own:
the 24 layers of BERT-Large share one compiled graph, so a cold compile traces and lowers one layer instead of 24
(`python -m benchmarks.throughput.training --compile`, and `--compile whole`, print the first step's time). The
blocks are compiled in a copy that shares every parameter and buffer with the model: the model itself stays eager, so
evaluation, EMA and the averaged replicas run it (and copies of it) as they did beside a whole-model compile, and
compile nothing of their own (eval mode, no_grad and their batch shapes would each add graphs). Other models are
compiled whole.

The copy's forward builds its graphs' guards with every parameter's `requires_grad` checked on each call. JointSpar
switches the parameters of the layers it did not draw to `requires_grad=False` between steps, and by default dynamo
skips the guards of a tensor held in a module's dict whose entries did not change. Torch builds without the fix
(pytorch/pytorch#177158; 2.11.0 among them) then run a region's graph traced with its layer frozen after the layer
was drawn: the layer gets no gradient, and a step whose drawn layers are all such regions has a loss without a
`grad_fn` (an H100 run of 2.11.0 failed so).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from models._registry import _spec


def compiled_for_training(name: str, model: nn.Module,
                          wrap: Callable[[nn.Module], nn.Module] = lambda module: module) -> nn.Module:
    """The module to train `model` (built by model `name`) with: its regions compiled one by one in a copy sharing
    its tensors, or, for a model without regions, the whole model compiled. `wrap` (DDP) goes around the copy, or
    inside the whole-model compile, where torch.compile splits the graph at DDP's buckets."""
    regions = _spec(name).compile_regions
    if regions is None:
        return torch.compile(wrap(model))
    shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo=shared)
    for region in regions(twin):
        region.compile()
    twin.forward = _guarding_requires_grad(twin.forward)
    return wrap(twin)


def _guarding_requires_grad(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` with the guards that dynamo builds and checks as it runs covering each parameter's
    `requires_grad` (the module docstring says why)."""
    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(skip_tensor_guards_with_matching_dict_tags=False):
            return forward(*args, **kwargs)

    return guarded


def compiles_by_regions(name: str) -> bool:
    """Whether `compiled_for_training` compiles model `name` region by region (else as a whole)."""
    return _spec(name).compile_regions is not None
