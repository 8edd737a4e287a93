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
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import torch

from benchmarks.common import (
    SIZES,
    StepTraffic,
    bert_parameters,
    bytes_touched,
    config_kwargs,
    markdown_table,
    optimizer_stepper,
)
from optim import build_optimizer, get_optimizer_spec
from optim._math import FOREACH_CHUNK_NUMEL
from optim.apex import APEX_OPTIMIZERS, runnable_optimizers
from optim.mirror_comm import MirrorComm

# Steps taken before the counted one: past the 1-bit warm-up (freeze at step 2) and past every first-step setup.
COMPRESSED_FROM = {"onebit_lamb": {"freeze_step": 2}, "onebit_adam": {"freeze_step": 2},
                   "zero_one_adam": {"var_freeze_step": 2}}
SETTLING_STEPS = 4
# Optimizers that take another path on the meta device than on the CPU or a GPU: counted on the CPU.
REAL_DEVICE_ONLY = {"adamw"}  # torch's AdamW runs its fused kernel on real devices only


def counted_optimizers() -> list[str]:
    """Every registered optimizer this machine can count (apex's kernels take CUDA tensors only)."""
    return [name for name in runnable_optimizers() if name not in APEX_OPTIMIZERS]


def count_step_on(name: str, size: str, ranks: int, device: torch.device) -> dict[str, object]:
    """`count_step` on `device`, or on the CPU where the step needs real tensors; `ranks` for the optimizers that
    communicate (one rank for the others)."""
    world = ranks if get_optimizer_spec(name).grad_sync == "self" else 1
    if device.type == "meta" and name not in REAL_DEVICE_ONLY:
        try:
            return count_step(name, size, world, device)
        except (NotImplementedError, RuntimeError):  # host reads, host-side draws, kernels without a meta version
            pass
    return count_step(name, size, world, torch.device("cpu"))


@contextlib.contextmanager
def gpu_chunks() -> Iterator[None]:
    """Tensor lists chunked as on a GPU, whatever device counts the step."""
    saved = dict(FOREACH_CHUNK_NUMEL)
    FOREACH_CHUNK_NUMEL.update(cpu=saved["cuda"], meta=saved["cuda"])
    try:
        yield
    finally:
        FOREACH_CHUNK_NUMEL.clear()
        FOREACH_CHUNK_NUMEL.update(saved)


def count_step(name: str, size: str, world_size: int, device: torch.device) -> dict[str, object]:
    """One row: optimizer `name`'s step on BERT-`size` parameters, counted after `SETTLING_STEPS` steps."""
    model = bert_parameters(size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {p: p.grad for p in params}
    with gpu_chunks():
        optimizer = build_optimizer(model, name, config_kwargs(name, **COMPRESSED_FROM.get(name, {})),
                                    comm=MirrorComm(world_size))
        step = optimizer_stepper(name, optimizer, grads, clock=lambda: 0.0)
        for _ in range(SETTLING_STEPS):
            step()
        with StepTraffic() as traffic:
            step()
    floor = bytes_touched(params, optimizer)
    return {"optimizer": name, "device": device.type, "ranks": world_size, "tensors": len(params), "ops": traffic.ops,
            "GB moved": traffic.bytes / 1e9, "GB floor": floor / 1e9, "x floor": traffic.bytes / floor}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--ranks", type=int, default=1, help="mirrored ranks of the optimizers that communicate")
    parser.add_argument("--device", choices=["meta", "cpu"], default="meta",
                        help="meta: shapes only (fast), and the CPU for a step that needs real tensors")
    parser.add_argument("--optimizers", nargs="+", default=None, help="registered names (default: every one)")
    args = parser.parse_args(argv)
    rows = []
    for name in args.optimizers or counted_optimizers():
        rows.append(count_step_on(name, args.size, args.ranks, torch.device(args.device)))
        print(f"counted {name}", flush=True)
    print(f"optimizer step traffic, BERT-{args.size} | torch {torch.__version__} | {args.device} | "
          f"after {SETTLING_STEPS} steps")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
