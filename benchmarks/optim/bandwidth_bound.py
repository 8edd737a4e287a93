"""Each optimizer's step time as a ratio to its memory-bandwidth bound, on BERT-sized parameters.

    python -m benchmarks.optim.bandwidth_bound --size large                 # BERT-Large on the GPU
    python -m benchmarks.optim.bandwidth_bound --size tiny --device cpu     # what the tests run

An optimizer step reads and writes memory far more than it computes, so its floor is set by bandwidth. The
bound of a step is the bytes a single fused pass must touch (read the parameters, the gradients and the
optimizer's persistent state; write the parameters and the state back) divided by the device's copy bandwidth,
measured in the same run (a large device-to-device copy, bytes read plus written). A ratio of 1 is the best any
implementation could do. Optimizers that synchronise themselves take their multi-rank path through a loopback
communication layer (`optim.comm.MirrorComm` of one rank) whose collectives return at once (their compressed
stages included), so no network time is counted; the 1-bit optimizers are timed after their warm-up stage, in the
compressed one.

`host ms` is the least time the host took to return from a step: where it nears `min ms`, the step waits for its
host (Python, launches, host draws), not for its kernels; `--host-profile` then names the functions it spends that
time in.

`--compiled` times the optimizers that take `compiled=True` with it (their math compiled by inductor; the warm-up
steps compile it), the others as they are; the `compiled` column says which. `--triton` does the same with
`triton=True` (the Triton kernels of LAMB, SLAMB, AdamW and the 1-bit family: CUDA only), in the `triton` column.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.common import (
    COMPRESSED_FROM,
    SIZES,
    bert_parameters,
    bytes_touched,
    chosen_device,
    config_kwargs,
    device_label,
    kernel_options,
    print_top_kernels,
)
from optim import build_optimizer
from optim.mirror_comm import MirrorComm

OPTIMIZERS = ["lamb", "slamb", "onebit_lamb", "zero_one_adam", "adamw"]


def copy_bandwidth(device: torch.device, numel: int, repeats: int = 5) -> float:
    """Bytes per second of the best of `repeats` copies of `numel` fp32 values, counting bytes read and written."""
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    best = min(_seconds(lambda: dst.copy_(src), device)[0] for _ in range(repeats + 1))
    return 2 * src.nbytes / best


def _seconds(work: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """The work's time to the end of its last kernel, and the host's until the call returned."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        start_s = time.perf_counter()
        work()
        host = time.perf_counter() - start_s
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host
    start_s = time.perf_counter()
    work()
    seconds = time.perf_counter() - start_s
    return seconds, seconds


def time_steps(optimizer: torch.optim.Optimizer, device: torch.device, warmup: int,
               repeats: int) -> list[tuple[float, float]]:
    """(time, host time) of each of `repeats` steps after `warmup` untimed ones (`_seconds`)."""
    for _ in range(warmup):
        optimizer.step()
    return [_seconds(optimizer.step, device) for _ in range(repeats)]


def print_host_profile(step: Callable[[], None], device: torch.device, top: int, steps: int = 3) -> None:
    """The `top` Python functions by their own time over `steps` steps (cProfile): where a host-bound step goes."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    print(f"host profile of {steps} steps, top {top} functions by their own time:")
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="large")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, help="registered optimizer names")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (past the 1-bit warm-up)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per optimizer")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after each optimizer's timing, profile 3 of its steps and print the N kernels (CPU: ops) "
                        "that take most time: where a step's time goes when its bytes do not say")
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="after each optimizer's timing, profile 3 of its steps on the host (cProfile) and print "
                        "the N Python functions that take most time: where a step whose host time nears its time goes")
    parser.add_argument("--compiled", action="store_true",
                        help="compiled=True for the optimizers that take it (the warm-up steps compile)")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE", type=_inductor_setting,
                        help="with --compiled: torch._inductor.config settings for the compiles, e.g. "
                        "combo_kernels=True (a launch for many tensors' kernels) or triton.cudagraphs=True")
    parser.add_argument("--triton", action="store_true",
                        help="triton=True for the optimizers that take it (their Triton kernels; CUDA only)")
    args = parser.parse_args(argv)
    if args.compiled and args.triton:
        parser.error("--compiled and --triton are two ways to fuse a step: choose one")
    if args.inductor and not args.compiled:
        parser.error("--inductor: its settings apply to compiled steps; add --compiled")
    with torch._inductor.config.patch(dict(args.inductor)):
        _time_optimizers(args, parser)


def _inductor_setting(text: str) -> tuple[str, object]:
    """`KEY=VALUE` for `torch._inductor.config.patch`: the value read as a Python literal (True, 4, "name")."""
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        parsed = ast.literal_eval(value)  # None too: some settings take it
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE with a Python literal value, e.g. "
                                         "combo_kernels=True") from None
    if key not in torch._inductor.config.get_config_copy():
        raise argparse.ArgumentTypeError(f"{key!r} is no torch._inductor.config setting of torch {torch.__version__}")
    return key, parsed


def _time_optimizers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The table: each optimizer's step timed against its bandwidth bound."""
    device = chosen_device(parser, args.device)
    model = bert_parameters(args.size, device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    bandwidth = copy_bandwidth(device, min(numel, 1 << 28))
    where = device_label(device)
    print(f"optimizer step vs bandwidth bound, BERT-{args.size}: {numel / 1e6:.1f}M fp32 parameters in "
          f"{len(params)} tensors | {where} | torch {torch.__version__} | copy bandwidth {bandwidth / 1e9:.0f} GB/s "
          f"(read + write) | min and median of {args.repeats} steps after {args.warmup}")
    print(f"{'optimizer':<15} {'compiled':>8} {'triton':>6} {'GB touched':>10} {'bound ms':>9} {'min ms':>8} "
          f"{'median ms':>10} {'host ms':>8} {'min x bound':>12}")
    for name in args.optimizers:
        kernels = kernel_options(name, args.compiled, args.triton)
        options = COMPRESSED_FROM.get(name, {}) | kernels
        optimizer = build_optimizer(model, name, config_kwargs(name, **options), comm=MirrorComm(1))
        timed = time_steps(optimizer, device, args.warmup, args.repeats)
        times, host = [seconds for seconds, _ in timed], min(host for _, host in timed)
        touched = bytes_touched(params, optimizer)
        bound = touched / bandwidth
        compiled, triton = kernels.get("compiled", False), kernels.get("triton", False)
        print(f"{name:<15} {compiled!s:>8} {triton!s:>6} {touched / 1e9:>10.3f} {bound * 1e3:>9.2f} "
              f"{min(times) * 1e3:>8.2f} {statistics.median(times) * 1e3:>10.2f} {host * 1e3:>8.2f} "
              f"{min(times) / bound:>12.2f}",
              flush=True)
        if args.profile:
            print_top_kernels(optimizer.step, device, args.profile)
        if args.host_profile:
            print_host_profile(optimizer.step, device, args.host_profile)
        del optimizer


if __name__ == "__main__":
    main()
