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
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    SIZES,
    StepTraffic,
    bert_parameters,
    bytes_touched,
    config_kwargs,
    markdown_table,
    optimizer_stepper,
    runnable_optimizers,
)
from optim import build_optimizer, get_optimizer_spec
from optim.comm import MirrorComm

# Steps taken before the counted one: past the 1-bit warm-up (freeze at step 2) and past every first-step setup.
COMPRESSED_FROM = {"onebit_lamb": {"freeze_step": 2}, "onebit_adam": {"freeze_step": 2},
                   "zero_one_adam": {"var_freeze_step": 2}}
SETTLING_STEPS = 4


def count_step(name: str, size: str, world_size: int, device: torch.device) -> dict[str, object]:
    """One row: optimizer `name`'s step on BERT-`size` parameters, counted after `SETTLING_STEPS` steps."""
    model = bert_parameters(size, device)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {p: p.grad for p in params}
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
                        help="meta: shapes only (fast), and the CPU for a step that reads values back to the host")
    parser.add_argument("--optimizers", nargs="+", default=None, help="registered names (default: every one)")
    args = parser.parse_args(argv)
    names = args.optimizers or [n for n in runnable_optimizers() if n not in ("adamw_apex", "lamb_apex")]
    rows = []
    for name in names:
        world = args.ranks if get_optimizer_spec(name).grad_sync == "self" else 1
        try:
            rows.append(count_step(name, args.size, world, torch.device(args.device)))
        except (NotImplementedError, RuntimeError):  # the step needs real values (host reads, host-side draws)
            rows.append(count_step(name, args.size, world, torch.device("cpu")))
        print(f"counted {name}", flush=True)
    print(f"optimizer step traffic, BERT-{args.size} | torch {torch.__version__} | {args.device} | "
          f"after {SETTLING_STEPS} steps")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
