"""Step time of 1-bit Adam, 1-bit LAMB and 0/1 Adam against LAMB, and their bits per parameter per step.

    python -m benchmarks.onebit_step                     # step times on 2 gloo ranks (BERT-tiny shapes), volume
    python -m benchmarks.onebit_step --size base --world-size 2
    python -m benchmarks.onebit_step --volume-only

Step time: every optimizer steps the same BERT-shaped parameters with random gradients on `--world-size`
gloo ranks; each stage of each algorithm is timed separately (the step kind follows the optimizer's own
schedule) and reported as the median over its steps, as a ratio to LAMB's step plus the fp32 gradient
all-reduce DDP would run for it (the reference, measured in the same run). On a CPU the collectives run
over shared memory, so the ratios say what the extra computation (packing, error feedback, copies) costs,
not what a network would save.

Volume: bits per parameter per step over a full BERT-Large phase-1 schedule (7038 steps) from each
optimizer's communication schedule and the byte counts of `optim.comm.Comm` (the tests check that the
counted bytes equal these predictions step by step on 2 and 4 ranks). SLAMB's figure comes from its
configuration (conf/optim/slamb.yaml: k, H, tau) and BERT-Large's tensor shapes, by the formula of
`slamb_bits_per_step` (masked coordinates drawn with probability k are counted at their expectation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import yaml
from transformers import BertConfig, BertForPreTraining

from optim.compressed import bucket_layout, compressed_bytes_per_call
from optim.param_groups import param_groups_weight_decay
from optim.zero_one_adam import zero_one_adam_step_kinds

SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
PHASE1_STEPS = 7038
PUBLISHED_STEPS = 152511


def bert(size: str, device: str = "meta") -> torch.nn.Module:
    with torch.device(device):
        model = BertForPreTraining(BertConfig(vocab_size=30528, **SIZES[size]))
    return model


# ------------------------------------------------------------------------------------------------ volume
def _bucket_sizes(model: torch.nn.Module, bucketing: str) -> list[int]:
    groups = param_groups_weight_decay(model, 0.01)
    numels = [p.numel() for g in groups for p in g["params"]]
    return [sum(numels[i] for i in bucket) for bucket in bucket_layout([len(g["params"]) for g in groups], bucketing)]


def onebit_bits_per_step(kinds: list[str], model: torch.nn.Module, bucketing: str, world_size: int) -> float:
    """Mean bits per parameter per step of a 1-bit-family schedule (Comm's counting: input bytes per rank)."""
    numel = sum(p.numel() for p in model.parameters())
    compressed = sum(compressed_bytes_per_call(n, world_size) for n in _bucket_sizes(model, bucketing))
    per_kind = {"init": 0, "local": 0, "dense": 4 * numel, "variance": 4 * numel, "compressed": compressed,
                "onebit_grad": compressed, "sync": compressed}
    return 8 * sum(per_kind[k] for k in kinds) / len(kinds) / numel


def freeze_kinds(steps: int, freeze_step: int) -> list[str]:
    return ["init"] + ["dense" if t <= freeze_step else "compressed" for t in range(2, steps + 1)]


def slamb_bits_per_step(model: torch.nn.Module, steps: int, cfg: dict[str, Any]) -> float:
    """Per step k of the masked coordinates plus every always-synced one, and a dense
    parameter average every H steps, all in the communication dtype."""
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
    model = bert("large")
    numel = sum(p.numel() for p in model.parameters())
    warm = round(0.2843 * PHASE1_STEPS)  # the phase-1 LR warm-up of conf/experiment/bert_large_phase1.yaml
    scaled = lambda n: round(n / PUBLISHED_STEPS * PHASE1_STEPS)  # noqa: E731
    rows: list[tuple[str, str, list[str], str]] = [
        ("LAMB (DDP, fp32 gradients)", "-", ["dense"] * PHASE1_STEPS, "per_group"),
        ("1-bit LAMB, published", "freeze_step 1000", freeze_kinds(PHASE1_STEPS, 1000), "flat_scaled"),
        ("1-bit Adam, freeze scaled", f"freeze_step {scaled(23000)} (23000/152511 of the run)",
         freeze_kinds(PHASE1_STEPS, scaled(23000)), "per_group"),
        ("0/1 Adam, published policy", f"var_freeze_step {warm} (end of warm-up), alpha 32678, H 16",
         zero_one_adam_step_kinds(PHASE1_STEPS, warm), "per_group"),
        ("0/1 Adam, alpha scaled", f"var_freeze_step {warm}, alpha {scaled(32678)}, H 16",
         zero_one_adam_step_kinds(PHASE1_STEPS, warm, local_step_scaler=scaled(32678)), "per_group"),
    ]
    header = "| optimizer | settings | " + " | ".join(f"bits/param/step, W={w}" for w in world_sizes) + " |"
    lines = [f"BERT-Large ({numel / 1e6:.1f}M parameters), phase 1: {PHASE1_STEPS} steps", "", header,
             "|---|---|" + "---|" * len(world_sizes)]
    for label, settings, kinds, bucketing in rows:
        values = " | ".join(f"{onebit_bits_per_step(kinds, model, bucketing, w):.3f}" for w in world_sizes)
        lines.append(f"| {label} | {settings} | {values} |")
    try:
        with open("conf/optim/slamb.yaml") as f:
            slamb_cfg = yaml.safe_load(f)
        slamb = slamb_bits_per_step(model, PHASE1_STEPS, slamb_cfg)
        lines.append(f"| SLAMB (formula) | k {slamb_cfg['compress_ratio']}, H "
                     f"{slamb_cfg['sync_interval']}, tau {slamb_cfg['min_compress_numel']}, "
                     f"{slamb_cfg['comm_dtype']} | " + " | ".join(f"{slamb:.3f}" for _ in world_sizes) + " |")
    except FileNotFoundError:
        lines.append("| SLAMB | conf/optim/slamb.yaml absent | - |")
    lines += ["", f"Published BERT-Large schedule ({PUBLISHED_STEPS} steps, batch 4096), "
              f"W={world_sizes[-1]}:", "", "| optimizer | bits/param/step | vs fp32 Adam |", "|---|---|---|"]
    for label, kinds in (("1-bit Adam, freeze_step 23000", freeze_kinds(PUBLISHED_STEPS, 23000)),
                         ("0/1 Adam, var_freeze_step 12500", zero_one_adam_step_kinds(PUBLISHED_STEPS, 12500))):
        bits = onebit_bits_per_step(kinds, model, "per_group", world_sizes[-1])
        lines.append(f"| {label} | {bits:.3f} | {32 / bits:.1f}x less |")
    return lines


# ------------------------------------------------------------------------------------------------ step time
def _timed_rank(rank: int, world_size: int, size: str, steps: int) -> dict[str, list[float]]:
    from optim import LAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam
    from optim.comm import Comm
    from optim.compressed import average_

    torch.set_num_threads(1)
    comm = Comm()
    model = bert(size, "cpu")
    params = list(model.parameters())
    g = torch.Generator().manual_seed(rank)
    grads = [torch.empty_like(p).normal_(0, 1e-3, generator=g) for p in params]

    def groups():
        return param_groups_weight_decay(model, 0.01)

    half = steps // 2
    zo = dict(var_freeze_step=half, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
    runs = {
        "LAMB + fp32 all-reduce (reference)": (LAMB(groups(), lr=1e-4, max_grad_norm=None), None, True),
        "LAMB step alone": (LAMB(groups(), lr=1e-4, max_grad_norm=None), None, False),
        "1-bit Adam": (OneBitAdam(groups(), lr=1e-4, freeze_step=half, comm=comm),
                       freeze_kinds(steps, half), False),
        "1-bit LAMB": (OneBitLAMB(groups(), lr=1e-4, freeze_step=half, comm=comm),
                       freeze_kinds(steps, half), False),
        "0/1 Adam": (ZeroOneAdam(groups(), lr=1e-4, comm=comm, **zo),
                     zero_one_adam_step_kinds(steps, **zo), False),
    }
    times: dict[str, list[float]] = defaultdict(list)
    for t in range(steps):  # interleaved, so drifting machine load hits every optimizer alike
        for name, (optimizer, kinds, allreduce) in runs.items():
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
            comm.barrier()
            start = time.perf_counter()
            if allreduce:
                average_([p.grad for p in params], comm)
            optimizer.step()
            elapsed = time.perf_counter() - start
            kind = kinds[t] if kinds else "every step"
            if t >= 2 and kind != "init":  # skip the first, allocating steps
                times[f"{name} | {kind}"].append(elapsed)
    return dict(times)


def step_time_table(size: str, world_size: int, steps: int) -> list[str]:
    sys.path.insert(0, "tests")
    from distributed_harness import run_on_ranks

    times = run_on_ranks(_timed_rank, world_size, size, steps)[0]
    reference = statistics.median(times["LAMB + fp32 all-reduce (reference) | every step"])
    numel = sum(p.numel() for p in bert(size).parameters())
    lines = [f"Step time, BERT-{size} shapes ({numel / 1e6:.1f}M parameters), {world_size} gloo ranks on the CPU, "
             f"1 thread per rank, torch {torch.__version__}; median per stage, rank 0", "",
             "| optimizer | stage | steps timed | ms | vs LAMB + all-reduce |", "|---|---|---|---|---|"]
    for key, values in times.items():
        name, kind = key.split(" | ")
        ms = statistics.median(values) * 1e3
        lines.append(f"| {name} | {kind} | {len(values)} | {ms:.1f} | {ms / 1e3 / reference:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24, help="steps per optimizer (half warm-up / phase 1)")
    parser.add_argument("--volume-only", action="store_true")
    args = parser.parse_args(argv)
    lines = volume_table()
    if not args.volume_only:
        lines += ["", *step_time_table(args.size, args.world_size, args.steps)]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
