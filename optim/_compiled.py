"""Optimizer math compiled by torch.compile (inductor): each pass over a chunk's tensors in fused kernels.

Aten ops read and write their operands once each, so an update written as a dozen elementwise ops moves a dozen
tensors' worth of memory where one fused pass would move the few it needs. Inductor fuses a pass's elementwise
ops, and the reductions they feed (LAMB's norms), into one kernel per tensor. The optimizers keep their collectives
and anything that reads a value on the host outside these functions.

A compiled function is traced once per set of input shapes (`dynamic=False`: flat buffers and a model's tensors
keep their shapes), so a run compiles during its first steps and never after. Values that change every step (the
learning rate, the step count of the bias corrections) enter as 0-d tensors on the device, never as Python
numbers, which would be baked into the graph and recompile it each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from optim.flat import foreach_chunks

# Graphs one compiled function may hold (dynamo's default is 8, after which it silently runs eagerly): one per run
# of tensors of distinct shapes (a model's identical layers share them), a few dozen for BERT-Large.
GRAPHS_PER_FUNCTION = 256
# Tensors per list of a compiled graph. In larger graphs inductor leaves some tensors' passes unfused (LAMB's first
# pass, 64K-element tensors on the CPU: up to 12 a graph, each in one kernel; 16, one of them reads its weights
# twice; 24, 17 of them do; BERT-Large's chunks, all).
TENSORS_PER_GRAPH = 12


class CompiledMath:
    """`fn` compiled by inductor on its first call: the whole function one graph (`fullgraph`), static shapes,
    with inductor's `options` (see `torch._inductor.config`).

    One instance per function, at module level: dynamo keeps its graphs per function, shared by every optimizer.
    """

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self.options = options
        self._compiled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options)
        with torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_FUNCTION):
            return self._compiled(*args, **kwargs)


def graph_chunks(tensors: Sequence[Tensor]) -> list[slice]:
    """`foreach_chunks` of `tensors`, each cut into runs of at most `TENSORS_PER_GRAPH`: the slices of a tensor list
    that one call of a compiled function takes."""
    return [slice(start, min(start + TENSORS_PER_GRAPH, chunk.stop))
            for chunk in foreach_chunks(tensors) for start in range(chunk.start, max(chunk.stop, chunk.start + 1),
                                                                     TENSORS_PER_GRAPH)]


def device_scalars(device: torch.device, *values: float) -> list[Tensor]:
    """`values` as 0-d float64 tensors on `device`, each made by a fill (no host-to-device copy, so no sync)."""
    return [torch.full((), value, dtype=torch.float64, device=device) for value in values]
