"""The host's share of an optimizer step on a GPU's layout, measured on the CPU: the main thread's time per step.

    python -m benchmarks.optim.host_time --optimizers slamb --triton
    python -m benchmarks.optim.host_time --size tiny --optimizers slamb --repeats 3
    python -m benchmarks.optim.host_time --optimizers slamb --triton --gap-ms 0 --ahead 1   # steps back to back

A GPU step whose kernels are short is bound by the host that launches them. Its parameters here live on the meta
device, so every op costs its Python and dispatch time and no arithmetic, on a GPU's layout (chunks, one mask draw,
the next step's masks drawn ahead). Between steps the main thread spends `--gap-ms` on other work, holding the GIL, as
a trainer's forward and backward launches do. Each optimizer runs twice in one process, interleaved: with SLAMB's
mask draws on their threads (`MaskSampler.draw_ahead`, what a GPU does) and with the draw in the step, the reference.

Meta ops are not CUDA ops: some run Python decompositions slower than a GPU's dispatch, so the absolute times are a
bound on the host's share, not a forecast of it. The ratio to the reference in the same run is the figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from benchmarks.common import (
    COMPRESSED_FROM,
    SIZES,
    bert_parameters,
    config_kwargs,
    gpu_chunks,
    kernel_options,
    meta_kernels,
    optimizer_stepper,
)
from optim import build_optimizer, get_optimizer_spec
from optim.mirror_comm import MirrorComm
from optim.slamb import _layout


def _busy(seconds: float) -> None:
    """Host work that holds the GIL (Python), as launching a forward and backward pass does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def host_times(name: str, size: str, triton: bool, gap: float, warmup: int, repeats: int,
               ahead_steps: int) -> dict[str, list[float]]:
    """Main-thread seconds per step of optimizer `name`, with SLAMB's masks of `ahead_steps` steps drawn ahead on
    their threads and drawn in the step (the same for the others)."""
    geometry = _layout.GEOMETRIES["cuda"]
    steppers = {}
    with gpu_chunks():
        for label, ahead in (("drawn ahead", ahead_steps), ("drawn in the step", 0)):
            model = bert_parameters(size, torch.device("meta"))
            grads = {p: p.grad for p in model.parameters() if p.requires_grad}
            world = 2 if get_optimizer_spec(name).grad_sync == "self" else 1
            options = COMPRESSED_FROM.get(name, {}) | kernel_options(name, triton=triton)
            with meta_kernels(triton):
                optimizer = build_optimizer(model, name, config_kwargs(name, **options), comm=MirrorComm(world))
            steppers[label] = optimizer_stepper(name, optimizer, grads, clock=time.perf_counter)
            _layout.GEOMETRIES["cuda"] = dataclasses.replace(geometry, draw_ahead=ahead)
            try:
                steppers[label]()  # the first step builds SLAMB's layout, with this geometry
            finally:
                _layout.GEOMETRIES["cuda"] = geometry
    times: dict[str, list[float]] = {label: [] for label in steppers}
    with gpu_chunks():
        for round_ in range(warmup + repeats):
            for label, step in steppers.items():
                seconds = step()
                _busy(gap)
                if round_ >= warmup:
                    times[label].append(seconds)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--optimizers", nargs="+", default=["slamb"], help="registered names")
    parser.add_argument("--triton", action="store_true", help="triton=True where the optimizer takes it")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="other host work between steps")
    parser.add_argument("--ahead", type=int, default=_layout.GEOMETRIES["cuda"].draw_ahead,
                        help="steps whose masks are drawn ahead, each on a thread (default: a GPU's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    if args.ahead < 1:
        parser.error(f"--ahead: {args.ahead}; draw at least one step ahead (drawn in the step is the reference)")
    print(f"main-thread time per optimizer step, BERT-{args.size} shapes on the meta device (a GPU's layout), "
          f"{args.gap_ms:g} ms of other host work between steps, masks of {args.ahead} steps drawn ahead | torch "
          f"{torch.__version__} | min and median of {args.repeats} after {args.warmup}")
    print(f"{'optimizer':<15} {'triton':>6} {'masks':<18} {'min ms':>8} {'median ms':>10} {'min x ref':>10}")
    for name in args.optimizers:
        times = host_times(name, args.size, args.triton, args.gap_ms / 1e3, args.warmup, args.repeats, args.ahead)
        reference = min(times["drawn in the step"])
        for label, seconds in times.items():
            print(f"{name:<15} {kernel_options(name, triton=args.triton).get('triton', False)!s:>6} {label:<18} "
                  f"{min(seconds) * 1e3:>8.2f} {statistics.median(seconds) * 1e3:>10.2f} "
                  f"{min(seconds) / reference:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
