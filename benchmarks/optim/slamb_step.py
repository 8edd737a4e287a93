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
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import SIZES, bert_parameters, chosen_device, config_kwargs, device_label, step_times
from optim import build_optimizer
from optim.memory import state_bytes
from optim.mirror_comm import MirrorComm

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
    for label, (registry_name, overrides) in VARIANTS.items():
        slamb = build_optimizer(model, registry_name, config_kwargs(registry_name, **overrides), comm=MirrorComm(1))
        times = step_times({REFERENCE: lamb, label: slamb}, device, args.warmup, args.repeats, clock)
        best_ref, median_ref = min(times[REFERENCE]), statistics.median(times[REFERENCE])
        reference_bytes = state_bytes(lamb)  # LAMB's state exists once it has stepped
        if label == next(iter(VARIANTS)):
            _row(REFERENCE, times[REFERENCE], best_ref, median_ref, reference_bytes, 0, reference_bytes)
        memory = slamb.memory_bytes()
        _row(label, times[label], best_ref, median_ref, memory["state"], memory["scratch"], reference_bytes)
        del slamb


def _row(label: str, values: list[float], best_ref: float, median_ref: float, state: int, scratch: int,
         reference_bytes: int) -> None:
    best, median = min(values), statistics.median(values)
    print(f"{label:<42} {best * 1e3:>8.1f} {median * 1e3:>10.1f} {best / best_ref:>7.2f} {median / median_ref:>9.2f} "
          f"{state / 2**20:>9.1f} {scratch / 2**20:>12.1f} {(state + scratch) / reference_bytes:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
