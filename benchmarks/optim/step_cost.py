"""Each optimizer's step counted on the CPU: the ops it dispatches and the bytes they read and write, against the
bytes one fused pass must touch.

    python -m benchmarks.optim.step_cost --size large     # BERT-Large shapes, on the meta device (seconds)
    python -m benchmarks.optim.step_cost --size tiny --ranks 2 --optimizers slamb onebit_lamb

An optimizer step is memory-bound, so the bytes its ops move set its time on a GPU. Counting them needs no GPU: a
dispatch mode sees every op the step dispatches and adds up the tensors it reads and writes. The parameters live
on the `meta` device, so BERT-Large's shapes cost no memory and no arithmetic. The floor is the traffic of one fused
pass (parameters read and written, gradients read, persistent state read and written: what
`benchmarks.optim.bandwidth_bound` divides by the copy bandwidth), so "x floor" is the step's bytes as a multiple
of the least any implementation moves. Optimizers that communicate take their multi-rank path through
`optim.comm.MirrorComm` of `--ranks` ranks (its collectives count as one read and write of their buffer, as an
in-place collective's kernel moves it on a GPU); the 1-bit family is counted in its compressed stage.

Tensor lists are chunked as on a GPU (`optim._math.FOREACH_CHUNK_NUMEL`), whatever device counts, so "ops" are the
ops a GPU's step dispatches. A step that needs real tensors (it reads values back to the host, or calls a kernel
with no meta version, as torch's fused SGD) is counted on the CPU instead, as is AdamW, whose fused kernel torch
takes on real devices only; the table's device column says which.

`--compiled` counts the steps with `compiled=True` (their math compiled by inductor, `optim._compiled`) on the CPU,
since inductor compiles for real devices only: ops are the aten ops the dispatch mode still sees plus one per kernel
a compiled graph runs, bytes theirs plus the bytes inductor counts for each compiled graph at every call of it
(`CompiledTraffic`). Optimizers without the option are counted as they are, and say so in the `compiled` column.

`host tensors` (on meta only) counts the CPU tensors the step's ops take: per-tensor host work that a GPU's step
waits for, however few the ops (a foreach op over a 0-d count per parameter is a loop on the host).

`--triton` counts the steps with `triton=True` (the Triton kernels of LAMB, SLAMB, AdamW and the 1-bit family) on
the meta device: each kernel is a torch custom op, which the dispatch mode counts as one op and one launch moving the
tensors it takes and mutates; on meta tensors it runs no kernel, so no GPU is needed. The `triton` column says which
rows have it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import unittest.mock
from typing import Any

import torch
import torch._inductor.metrics as inductor_metrics
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from benchmarks.common import (
    COMPRESSED_FROM,
    SIZES,
    StepTraffic,
    bert_parameters,
    bytes_touched,
    config_kwargs,
    gpu_chunks,
    kernel_options,
    markdown_table,
    meta_kernels,
    optimizer_stepper,
)
from optim import build_optimizer, get_optimizer_spec
from optim._compiled import CompiledMath
from optim.apex import APEX_OPTIMIZERS, runnable_optimizers
from optim.mirror_comm import MirrorComm

SETTLING_STEPS = 4  # steps before the counted one: past the 1-bit warm-up and past every first-step setup
# Optimizers that take another path on the meta device than on the CPU or a GPU: counted on the CPU.
REAL_DEVICE_ONLY = {"adamw"}  # torch's AdamW runs its fused kernel on real devices only


def counted_optimizers() -> list[str]:
    """Every registered optimizer this machine can count (apex's kernels take CUDA tensors only)."""
    return [name for name in runnable_optimizers() if name not in APEX_OPTIMIZERS]


def count_step_on(name: str, size: str, ranks: int, device: torch.device, compiled: bool = False,
                  triton: bool = False) -> dict[str, object]:
    """`count_step` on `device`, or on the CPU where the step needs real tensors (a compiled one always does; one with
    Triton kernels never: it is counted on meta); `ranks` for the optimizers that communicate (one rank for the
    others)."""
    world = ranks if get_optimizer_spec(name).grad_sync == "self" else 1
    kernels = kernel_options(name, compiled, triton)
    compiled = kernels.get("compiled", False)
    if kernels.get("triton"):
        return count_step(name, size, world, torch.device("meta"), triton=True)
    if device.type == "meta" and name not in REAL_DEVICE_ONLY and not compiled:
        try:
            return count_step(name, size, world, device)
        except (NotImplementedError, RuntimeError):  # host reads, host-side draws, kernels without a meta version
            pass
    return count_step(name, size, world, torch.device("cpu"), compiled)


class CompiledTraffic:
    """While active, each call of a compiled function (`optim._compiled.CompiledMath`) adds to `traffic` (when set)
    one op per kernel of the graph it runs and the bytes inductor counted for that graph.

    Inductor counts a graph's kernels and their bytes once, when it compiles it (`GraphLowering.count_bytes`: every
    buffer each fused kernel reads or writes, extern kernels included). The graph a call runs is keyed by the
    function and its arguments' shapes, strides, dtypes and constants (what its compiled code is specialised to),
    and costs what it cost in the call that compiled it. The dispatch mode is paused inside the compiled call: the
    aten ops of the compiled code are inductor's count. Activating it forgets every compiled graph (`dynamo.reset`)
    and turns off inductor's caches, so that each graph is compiled, hence counted, here.
    """

    def __init__(self) -> None:
        self.traffic: StepTraffic | None = None
        self.graphs: dict[tuple, tuple[int, int]] = {}  # key -> (kernels, bytes)
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> CompiledTraffic:
        torch._dynamo.reset()
        self._stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
        self._stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # on: inductor counts the bytes
        saved = log.level, log.propagate
        log.setLevel(logging.INFO)
        log.propagate = False
        self._stack.callback(lambda: (log.setLevel(saved[0]), setattr(log, "propagate", saved[1])))
        original = CompiledMath.__call__

        def counted_call(math: CompiledMath, *args: Any, **kwargs: Any) -> Any:
            key = (math.fn.__qualname__, *(_signature(leaf) for leaf in tree_leaves((args, kwargs))))
            before = len(inductor_metrics.nodes_num_elem), inductor_metrics.num_bytes_accessed
            with _disable_current_modes():
                out = original(math, *args, **kwargs)
            kernels = len(inductor_metrics.nodes_num_elem) - before[0]
            if kernels:  # compiled in this call
                self.graphs[key] = kernels, inductor_metrics.num_bytes_accessed - before[1]
            if self.traffic is not None:
                kernels, moved = self.graphs[key]
                self.traffic.ops += kernels
                self.traffic.launches += kernels
                self.traffic.bytes += moved
            return out

        self._stack.enter_context(unittest.mock.patch.object(CompiledMath, "__call__", counted_call))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        torch._dynamo.reset()


def _signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device.type
    return leaf


def count_step(name: str, size: str, world_size: int, device: torch.device, compiled: bool = False,
               triton: bool = False) -> dict[str, object]:
    """One row: optimizer `name`'s step on BERT-`size` parameters, counted after `SETTLING_STEPS` steps (with
    `compiled=True` when `compiled`: on the CPU; with `triton=True` when `triton`: on meta)."""
    model = bert_parameters(size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {p: p.grad for p in params}
    options = COMPRESSED_FROM.get(name, {}) | kernel_options(name, compiled, triton)
    with gpu_chunks(), CompiledTraffic() as compiled_traffic, meta_kernels(triton):
        optimizer = build_optimizer(model, name, config_kwargs(name, **options), comm=MirrorComm(world_size))
        step = optimizer_stepper(name, optimizer, grads, clock=lambda: 0.0)
        for _ in range(SETTLING_STEPS):
            step()
        with StepTraffic() as traffic:
            compiled_traffic.traffic = traffic
            step()
    floor = bytes_touched(params, optimizer)
    return {"optimizer": name, "compiled": compiled, "triton": triton, "device": device.type, "ranks": world_size,
            "tensors": len(params), "ops": traffic.ops, "launches": traffic.launches,
            "host tensors": traffic.host_tensors if device.type == "meta" else None,
            "GB moved": traffic.bytes / 1e9, "GB floor": floor / 1e9, "x floor": traffic.bytes / floor}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--ranks", type=int, default=1, help="mirrored ranks of the optimizers that communicate")
    parser.add_argument("--device", choices=["meta", "cpu"], default="meta",
                        help="meta: shapes only (fast), and the CPU for a step that needs real tensors")
    parser.add_argument("--optimizers", nargs="+", default=None, help="registered names (default: every one)")
    parser.add_argument("--compiled", action="store_true",
                        help="count the steps with compiled=True where the optimizer takes it (on the CPU: slow)")
    parser.add_argument("--triton", action="store_true",
                        help="count the steps with triton=True where the optimizer takes it (on meta)")
    args = parser.parse_args(argv)
    if args.compiled and args.triton:
        parser.error("--compiled and --triton are two ways to fuse a step: choose one")
    rows = []
    for name in args.optimizers or counted_optimizers():
        rows.append(count_step_on(name, args.size, args.ranks, torch.device(args.device), args.compiled, args.triton))
        print(f"counted {name}", flush=True)
    fused = (" | compiled where the optimizer takes it" if args.compiled else
             " | Triton kernels where the optimizer takes them" if args.triton else "")
    print(f"optimizer step traffic, BERT-{args.size} | torch {torch.__version__} | {args.device} | "
          f"after {SETTLING_STEPS} steps{fused}")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
