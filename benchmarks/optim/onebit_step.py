"""Step time of 1-bit Adam, 1-bit LAMB and 0/1 Adam against LAMB, and their bits per parameter per step.

    python -m benchmarks.optim.onebit_step                     # BERT-base shapes, 2 gloo ranks, 5 timed steps per stage
    python -m benchmarks.optim.onebit_step --size tiny --repeats 3 --optimizers "1-bit LAMB"
    python -m benchmarks.optim.onebit_step --volume-only

Step time: each 1-bit optimizer steps BERT-shaped parameters with random gradients on `--world-size` gloo
ranks (one thread each), in its own processes so that only one optimizer's state is in memory. Its schedule
is set so that every stage (warm-up, compressed; 0/1 Adam's variance, 1-bit gradient, sync and local steps)
comes `--repeats` + 1 times; the first step of each stage is not timed. Before each of its steps the
reference runs on the same gradients: the fp32 gradient all-reduce DDP would run, then LAMB's step. The
table gives min and median over the timed steps and their ratios to the reference's min and median from the
same processes. On a CPU the collectives run over shared memory, so the ratios say what the extra
computation (packing, error feedback, copies) costs, not what a network would save.

Volume: bits per parameter per step over a full BERT-Large phase-1 schedule (7038 steps) from each
optimizer's communication schedule and the byte counts of `optim.comm.Comm` (the tests check that the
counted bytes equal these predictions step by step on 2 and 4 ranks). SLAMB's figure comes from its
configuration (conf/optim/slamb.yaml: k, H, tau; fp32 and fp16 momentum) and BERT-Large's tensor shapes, by
the formula of `slamb_bits_per_step` (masked coordinates drawn with probability k are counted at their
expectation). Full-precision traffic is shown in fp32 and in fp16, so SLAMB and 1-bit LAMB compare like for like.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import yaml
from transformers import BertConfig, BertForPreTraining

from benchmarks.common import (
    CONF_OPTIM,
    PHASE1_STEPS,
    PHASE1_WARMUP,
    PUBLISHED_STEPS,
    SIZES,
    freeze_kinds,
    phase1_schedules,
    run_on_ranks,
    scaled_to_phase1,
    stage_kinds,
)
from optim.compressed import bucket_layout, compressed_bytes_per_call
from optim.param_groups import param_groups_weight_decay
from optim.zero_one_adam import zero_one_adam_step_kinds


def bert(size: str, device: str = "meta") -> torch.nn.Module:
    with torch.device(device):
        model = BertForPreTraining(BertConfig(vocab_size=30528, **SIZES[size]))
    return model


# ------------------------------------------------------------------------------------------------ volume
def _bucket_sizes(model: torch.nn.Module, bucketing: str) -> list[int]:
    groups = param_groups_weight_decay(model, 0.01)
    numels = [p.numel() for g in groups for p in g["params"]]
    return [sum(numels[i] for i in bucket) for bucket in bucket_layout([len(g["params"]) for g in groups], bucketing)]


def onebit_bits_per_step(kinds: list[str], model: torch.nn.Module, bucketing: str, world_size: int,
                         dense_bits: int = 32) -> float:
    """Mean bits per parameter per step of a 1-bit-family schedule (Comm's counting: input bytes per rank).

    `dense_bits`: the wire width of the full-precision stages (`dense_comm_dtype`: 32, or 16 for fp16/bf16).
    """
    numel = sum(p.numel() for p in model.parameters())
    compressed = sum(compressed_bytes_per_call(n, world_size) for n in _bucket_sizes(model, bucketing))
    dense = dense_bits // 8 * numel
    per_kind = {"init": 0, "local": 0, "dense": dense, "variance": dense, "compressed": compressed,
                "onebit_grad": compressed, "sync": compressed}
    return 8 * sum(per_kind[k] for k in kinds) / len(kinds) / numel


def slamb_bits_per_step(model: torch.nn.Module, steps: int, cfg: dict[str, Any]) -> float:
    """Per step k of the masked coordinates plus every always-synced one in the communication dtype, and
    a dense fp32 parameter average every H steps."""
    bits = {"fp32": 32, "fp16": 16, "bf16": 16}[cfg["comm_dtype"]]
    numel = always = 0
    for p in model.parameters():
        numel += p.numel()
        if p.dim() <= 1 or p.numel() < cfg["min_compress_numel"]:
            always += p.numel()
    syncs = sum(1 for t in range(1, steps + 1) if (t - cfg["sync_offset"]) % cfg["sync_interval"] == 0)
    per_step = bits * (cfg["compress_ratio"] * (numel - always) + always)
    return (steps * per_step + syncs * 32 * numel) / steps / numel


def volume_table(world_sizes: tuple[int, ...] = (8, 128)) -> list[str]:
    """Bits per parameter per step over BERT-Large phase 1, every optimizer with 32- and 16-bit full-precision
    traffic where it has any, and SLAMB against 1-bit LAMB like for like (the paper: about half)."""
    model = bert("large")
    numel = sum(p.numel() for p in model.parameters())
    warm, scaled, schedules = PHASE1_WARMUP, scaled_to_phase1, phase1_schedules()
    onebit_lamb_settings, onebit_lamb = schedules["onebit_lamb"]
    rows: list[tuple[str, str, int, list[str], str]] = [  # label, settings, dense bits, kinds, bucketing
        ("LAMB (DDP gradients)", "trainer.grad_allreduce_dtype fp32", 32, ["dense"] * PHASE1_STEPS, "per_group"),
        ("LAMB (DDP gradients)", "fp16 (NVIDIA's BERT)", 16, ["dense"] * PHASE1_STEPS, "per_group"),
        ("1-bit LAMB, published", f"{onebit_lamb_settings}, dense_comm_dtype fp32", 32, onebit_lamb, "flat_scaled"),
        ("1-bit LAMB, published", f"{onebit_lamb_settings}, fp16 (DeepSpeed fp16 runs)", 16, onebit_lamb,
         "flat_scaled"),
        ("1-bit Adam, freeze scaled", f"{schedules['onebit_adam'][0]}, fp32", 32, schedules["onebit_adam"][1],
         "per_group"),
        ("0/1 Adam, published policy", f"{schedules['zero_one_adam'][0]}, fp32", 32, schedules["zero_one_adam"][1],
         "per_group"),
        ("0/1 Adam, alpha scaled", f"var_freeze_step {warm}, alpha {scaled(32678)}, H 16, fp32", 32,
         zero_one_adam_step_kinds(PHASE1_STEPS, warm, local_step_scaler=scaled(32678)), "per_group"),
    ]
    header = "| optimizer | settings | " + " | ".join(f"bits/param/step, W={w}" for w in world_sizes) + " |"
    lines = [f"BERT-Large ({numel / 1e6:.1f}M parameters), phase 1: {PHASE1_STEPS} steps", "", header,
             "|---|---|" + "---|" * len(world_sizes)]
    onebit_lamb_bits = {}
    for label, settings, dense_bits, kinds, bucketing in rows:
        values = [onebit_bits_per_step(kinds, model, bucketing, w, dense_bits) for w in world_sizes]
        if label.startswith("1-bit LAMB"):
            onebit_lamb_bits[dense_bits] = values
        lines.append(f"| {label} | {settings} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    slamb_cfg = yaml.safe_load((CONF_OPTIM / "slamb.yaml").read_text())
    slamb_bits = {}
    for dtype, bits in (("fp32", 32), ("fp16", 16)):
        slamb_bits[bits] = slamb_bits_per_step(model, PHASE1_STEPS, slamb_cfg | {"comm_dtype": dtype})
        lines.append(f"| SLAMB (formula) | k {slamb_cfg['compress_ratio']}, H {slamb_cfg['sync_interval']}, tau "
                     f"{slamb_cfg['min_compress_numel']}, momentum in {dtype}, parameter average fp32 | "
                     + " | ".join(f"{slamb_bits[bits]:.3f}" for _ in world_sizes) + " |")
    lines += ["", "SLAMB / 1-bit LAMB, like for like (the paper: SLAMB sends about half of 1-bit LAMB's data): "
              + "; ".join(f"{name}: " + ", ".join(f"{slamb_bits[bits] / v:.2f} at W={w}"
                                                   for w, v in zip(world_sizes, onebit_lamb_bits[bits], strict=True))
                          for name, bits in (("fp32", 32), ("fp16", 16)))]
    lines += ["", f"Published BERT-Large schedule ({PUBLISHED_STEPS} steps, batch 4096), "
              f"W={world_sizes[-1]}:", "", "| optimizer | bits/param/step | vs fp32 Adam |", "|---|---|---|"]
    for label, kinds in (("1-bit Adam, freeze_step 23000", freeze_kinds(PUBLISHED_STEPS, 23000)),
                         ("0/1 Adam, var_freeze_step 12500", zero_one_adam_step_kinds(PUBLISHED_STEPS, 12500))):
        bits = onebit_bits_per_step(kinds, model, "per_group", world_sizes[-1])
        lines.append(f"| {label} | {bits:.3f} | {32 / bits:.1f}x less |")
    return lines


# ------------------------------------------------------------------------------------------------ step time
def _timed_rank(rank: int, world_size: int, size: str, name: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of optimizer `name` by stage, each step interleaved with one of the reference."""
    from optim import LAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam
    from optim.comm import Comm, average_tensors_
    from optim.onebit_adam import DENSE_BUCKET_NUMEL

    torch.set_num_threads(1)
    comm = Comm()
    model = bert(size, "cpu")
    params = list(model.parameters())
    g = torch.Generator().manual_seed(rank)
    grads = [torch.empty_like(p).normal_(0, 1e-3, generator=g) for p in params]
    groups = param_groups_weight_decay(model, 0.01)
    settings, kinds = stage_kinds(name, repeats)
    reference = LAMB(param_groups_weight_decay(model, 0.01), lr=1e-4, max_grad_norm=None)
    cls = {"1-bit Adam": OneBitAdam, "1-bit LAMB": OneBitLAMB, "0/1 Adam": ZeroOneAdam}[name]
    optimizer = cls(groups, lr=1e-4, comm=comm, **settings)

    def timed(run) -> float:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()  # fresh gradients: the optimizers may reuse their storage
        comm.barrier()
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    times: dict[str, list[float]] = defaultdict(list)
    seen: set[str] = set()
    for kind in kinds:  # interleaved, so drifting machine load hits both alike
        allreduce = timed(lambda: average_tensors_([p.grad for p in params], comm, DENSE_BUCKET_NUMEL))
        lamb_alone = timed(reference.step)
        step = timed(optimizer.step)
        if kind == "init" or kind not in seen:  # skip each stage's first, allocating step
            seen.add(kind)
            continue
        times["LAMB + fp32 all-reduce (reference)"].append(allreduce + lamb_alone)
        times["LAMB step alone"].append(lamb_alone)
        times["fp32 all-reduce alone"].append(allreduce)
        times[f"{name} | {kind}"].append(step)
    return dict(times)


def timed_on_ranks(world_size: int, *args: Any) -> dict[str, list[float]]:
    """`_timed_rank` on `world_size` gloo ranks; rank 0's times. No time limit: a loaded machine is only slow."""
    return run_on_ranks(_timed_rank, world_size, *args)[0]


ONEBIT = ("1-bit Adam", "1-bit LAMB", "0/1 Adam")


def step_time_table(size: str, world_size: int, repeats: int, names: Sequence[str] = ONEBIT) -> list[str]:
    """Min and median step time per stage of each 1-bit optimizer and its ratio to LAMB + fp32 all-reduce.

    Each optimizer runs in its own processes (one at a time in memory), interleaved with the reference.
    """
    numel = sum(p.numel() for p in bert(size).parameters())
    lines = [f"Step time, BERT-{size} shapes ({numel / 1e6:.1f}M parameters), {world_size} gloo ranks on the CPU, "
             f"1 thread per rank, torch {torch.__version__}; {repeats} timed steps per stage (rank 0); ratios to "
             "the reference's min and median measured in the same processes", "",
             "| optimizer | stage | min ms | median ms | min vs ref | median vs ref |", "|---|---|---|---|---|---|"]
    for name in names:
        times = timed_on_ranks(world_size, size, name, repeats)
        ref = times.pop("LAMB + fp32 all-reduce (reference)")
        ref_min, ref_median = min(ref), statistics.median(ref)
        rows = [("LAMB + fp32 all-reduce (reference)", ref)] + [(key, times[key]) for key in times]
        for key, values in rows:
            label, _, kind = key.partition(" | ")
            low, mid = min(values) * 1e3, statistics.median(values) * 1e3
            label = label if kind else f"{label} [{name} run]"
            lines.append(f"| {label} | {kind or '-'} | {low:.1f} | {mid:.1f} | {low / 1e3 / ref_min:.2f} | "
                         f"{mid / 1e3 / ref_median:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per stage of each optimizer")
    parser.add_argument("--optimizers", nargs="+", choices=ONEBIT, default=ONEBIT, help="which to time")
    parser.add_argument("--volume-only", action="store_true")
    args = parser.parse_args(argv)
    lines = volume_table()
    if not args.volume_only:
        lines += ["", *step_time_table(args.size, args.world_size, args.repeats, args.optimizers)]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
