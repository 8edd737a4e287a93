"""SLAMB's optimizer step time and state memory as ratios to LAMB's, on BERT-base and BERT-Large parameter sets.

    python -m benchmarks.optim.slamb_step --size base                    # one CPU thread, all variants
    python -m benchmarks.optim.slamb_step --size large --device cuda

Both optimizers are built by `optim.build_optimizer` from conf/optim/lamb.yaml and conf/optim/slamb.yaml (what
`optim=lamb` and `optim=slamb` run), over the same parameters and random gradients. SLAMB gets a loopback
communication layer (`optim.comm.MirrorComm` of one rank): it takes every step of the multi-rank path (mask draw,
gather of the synced momenta, the bucketed all-reduce call, scatter back) with collectives that return at once,
so the times are the optimizer's own work without the network. Each SLAMB variant is timed against LAMB in its
own round, steps interleaved (as in `benchmarks.optim.lamb_step`), so that only two optimizers' state is alive
at a time; each reports its best and its median step after warm-up, as ratios to LAMB's best and median of the
same round: the best is the least disturbed step, the median shows whether a shared machine moved the ratio.
Variants: SLAMB with each other mask (Slamb_V2's Bernoulli draw, the naive cyclic partition), with the naive
product-form rescale, and the slamb_v2_official preset. Memory is the bytes of the optimizer's
persistent tensors: LAMB's m and v (8 bytes per parameter); SLAMB's m, v and freshness (state: 10 bytes, 12 in
the parity preset, whose freshness is fp32) plus its work buffers (scratch), as a ratio to LAMB's.

Last, what SLAMB's step adds to LAMB's in memory traffic, timed in the same run: a gather and a scatter of a tenth of
the rows of 16 of a buffer of the model's size (the rows the stratified mask picks, one per stratum), each in units of
one streaming read of that buffer (a norm), beside LAMB's best step in the same unit. A row op touches a tenth of the
bytes of a pass, but on a CPU each 64-byte row waits for memory, so it costs about a pass: SLAMB's step makes three
gathers (m, v and the weights at S_t) and two scatters (the averaged m, and the direction formed from it) beside
LAMB's passes, whose kernels (fused Adam, two norms, the update) it shares. The last line divides the default SLAMB's
best and median step (of its round) by that bound: LAMB's best and median step of the same round plus the row ops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import (
    SIZES,
    bert_parameters,
    chosen_device,
    config_kwargs,
    device_label,
    step_times,
    timed,
)
from optim import build_optimizer
from optim.memory import state_bytes
from optim.mirror_comm import MirrorComm
from optim.slamb._masks import ROW_NUMEL

VARIANTS = {  # label -> (registry name, overrides of its conf/optim YAML)
    "SLAMB (conf/optim/slamb.yaml)": ("slamb", {}),
    "SLAMB mask=bernoulli": ("slamb", {"mask": "bernoulli"}),
    "SLAMB mask=cyclic": ("slamb", {"mask": "cyclic"}),
    "SLAMB rescale=product_of_interpolations": ("slamb", {"rescale": "product_of_interpolations"}),
    "SLAMB optim=slamb_v2_official": ("slamb_v2_official", {}),
}
REFERENCE = "LAMB (conf/optim/lamb.yaml, reference)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per optimizer (best and median kept)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall time, or this process's CPU time (steadier on a shared CPU; --device cpu only)")
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu: only for --device cpu")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    model = bert_parameters(args.size, device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    name = device_label(device)
    print(f"optimizer step, BERT-{args.size}: {numel / 1e6:.1f}M fp32 parameters in {len(params)} tensors | {name} | "
          f"torch {torch.__version__} | {args.repeats} interleaved steps after {args.warmup} warm-up, "
          f"{args.clock} clock | SLAMB k=0.1 with a loopback collective")
    print(f"{'optimizer':<42} {'best ms':>8} {'median ms':>10} {'best x':>7} {'median x':>9} {'state MB':>9} "
          f"{'+scratch MB':>12} {'memory x':>9}", flush=True)
    lamb = build_optimizer(model, "lamb", config_kwargs("lamb"))
    default = next(iter(VARIANTS))
    for label, (registry_name, overrides) in VARIANTS.items():
        slamb = build_optimizer(model, registry_name, config_kwargs(registry_name, **overrides), comm=MirrorComm(1))
        times = step_times({REFERENCE: lamb, label: slamb}, device, args.warmup, args.repeats, clock)
        best_ref, median_ref = min(times[REFERENCE]), statistics.median(times[REFERENCE])
        reference_bytes = state_bytes(lamb)  # LAMB's state exists once it has stepped
        if label == default:
            _row(REFERENCE, times[REFERENCE], best_ref, median_ref, reference_bytes, 0, reference_bytes)
            default_round = times
        memory = slamb.memory_bytes()
        _row(label, times[label], best_ref, median_ref, memory["state"], memory["scratch"], reference_bytes)
        del slamb
    del lamb
    stream, gather, scatter = row_traffic(numel, 0.1, device, args.repeats, clock)
    added = 3 * gather + 2 * scatter
    lamb_best, lamb_median = min(default_round[REFERENCE]), statistics.median(default_round[REFERENCE])
    print(f"row traffic, in streaming reads of {numel / 1e6:.1f}M fp32 values ({stream * 1e3:.1f} ms): gather of a "
          f"tenth of the rows of {ROW_NUMEL} {gather / stream:.2f}, scatter {scatter / stream:.2f}; LAMB's best step "
          f"{lamb_best / stream:.1f}; SLAMB's adds 3 gathers and 2 scatters: {added / stream:.1f}")
    print(f"bound, LAMB's step plus that row traffic: {(lamb_best + added) / lamb_best:.2f}x LAMB's best step; "
          f"{default}'s step over it: best {min(default_round[default]) / (lamb_best + added):.2f}x, median "
          f"{statistics.median(default_round[default]) / (lamb_median + added):.2f}x", flush=True)


def row_traffic(numel: int, ratio: float, device: torch.device, repeats: int,
                clock: Callable[[], float]) -> tuple[float, float, float]:
    """Best times (of `repeats`) of one streaming read of `numel` fp32 values (their norm), of a gather of `ratio`
    of their rows of `ROW_NUMEL` (one row at random in each of as many strata, as the stratified mask picks them)
    and of the scatter back, by the ops SLAMB's masks use."""
    generator = torch.Generator().manual_seed(0)
    rows = numel // ROW_NUMEL
    picks = max(1, round(ratio * rows))
    strata = torch.arange(picks + 1) * rows // picks
    chosen = strata[:-1] + (torch.rand(picks, generator=generator) * strata.diff()).long()
    buffer = torch.randn(rows, ROW_NUMEL, generator=generator).to(device)
    words = buffer.view(torch.float64)  # as `optim.slamb._masks.Mask` moves rows: 8-byte words
    chosen = chosen.to(device)
    compact = words.index_select(0, chosen)

    def best(op: Callable[[], object]) -> float:
        return min(timed(op, device, clock) for _ in range(repeats))

    return (best(lambda: torch.linalg.vector_norm(buffer)),
            best(lambda: torch.index_select(words, 0, chosen, out=compact)),
            best(lambda: words.index_copy_(0, chosen, compact)))


def _row(label: str, values: list[float], best_ref: float, median_ref: float, state: int, scratch: int,
         reference_bytes: int) -> None:
    best, median = min(values), statistics.median(values)
    print(f"{label:<42} {best * 1e3:>8.1f} {median * 1e3:>10.1f} {best / best_ref:>7.2f} {median / median_ref:>9.2f} "
          f"{state / 2**20:>9.1f} {scratch / 2**20:>12.1f} {(state + scratch) / reference_bytes:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
