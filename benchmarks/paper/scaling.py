"""Throughput and scaling efficiency of every optimizer from 8 to 1,024 GPUs, from an alpha-beta network model.

    python -m benchmarks.paper.scaling                               # ib100 between nodes of 8 A100s (NVLink3)
    python -m benchmarks.paper.scaling --network 10gbe --gpu v100 --csv scaling.csv --json scaling.json
    python -m benchmarks.paper.scaling --throughput bert_large=600 --runs runs/slamb runs/lamb

Communication profile (measured, then scaled): each optimizer, built from its conf/optim YAML, steps a tiny BERT
(hidden 128, 2 layers, 4.4M parameters) through one cycle of its schedule with a communication layer that takes
the multi-rank code path as if there were 8 identical ranks (`optim.comm.MirrorComm`) and records every collective
(kind and bytes; the collectives themselves return at once). SLAMB: H steps (one dense sync); SlowMo: its sync
interval; JointSpar: 20 sampled steps; the 1-bit family: every stage of its schedule (the stage settings of
`benchmarks.common.stage_kinds`, which benchmarks.optim.onebit_step times), weighted by the BERT-Large phase-1
schedule (benchmarks.common.phase1_schedules) for the schedule average; the steady state is the compression
stage (1-bit: compressed steps; 0/1 Adam: its phase 2; the others: their whole cycle).
DDP optimizers (LAMB, AdamW, LARS) are not stepped: DDP all-reduces every gradient once per step, in 25 MiB
buckets. Full-precision payloads travel in `--wire` (default fp16, as the paper's BERT runs and its baselines
sent them). Bytes per parameter are scaled by the target's parameter count (APPROXIMATION: the share of small
tensors SLAMB always syncs and the 1-bit padding differ between the tiny model and the target); an all-gather's
per-rank input is a 1/W share of the gathered bytes, so it is scaled as the gathered bytes divided by the
target's world size; a scaled call is split into the optimizer's buckets
(`bucket_mb`) as the optimizer would split it.

Compute per step: the per-GPU batch divided by a per-GPU training throughput: `--throughput` if given, else a
published figure (named in the output). BERT-XL's is BERT-Large's scaled by FLOPs (6 x parameters x tokens, same
tokens per sequence). BERT keeps the phase-1 global batch of 65,536 sequences at every GPU count (strong scaling);
Swin-B keeps 128 images per GPU, the SLAMB authors' Swin script (weak scaling). Communication is NOT overlapped
with compute (an upper bound on its cost: DDP overlaps its all-reduce with backward). Step time = compute + the
modelled collectives; scaling efficiency = compute / step time (100 %: linear scaling of a GPU that never
communicates). The network model and its nominal link figures are in optim/network.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    bert_parameters,
    config_kwargs,
    optimizer_stepper,
    phase1_schedules,
    stage_kinds,
)
from core.atomic import atomic_write_text
from core.errors import UserError, user_errors_exit
from optim import build_optimizer, get_optimizer_spec
from optim.apex import runnable_optimizers
from optim.comm import WIRE_DTYPES
from optim.mirror_comm import MirrorComm
from optim.network import LINKS, NETWORKS, NVLINKS, Cluster, collective_seconds
from train.run_dir import RunDir

MEASURE_WORLD = 8  # the pretend world size of the recorded steps
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
GPUS_PER_NODE = 8
IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC-2012 training set (Russakovsky et al., IJCV 2015)
SWIN_EPOCHS = 300  # the Swin-B recipe's (Liu et al. 2021); the SLAMB paper's epoch count is not known here
ONEBIT_LABELS = {"onebit_adam": "1-bit Adam", "onebit_lamb": "1-bit LAMB", "zero_one_adam": "0/1 Adam"}
STEADY_KINDS = ("cycle", "compressed", "sync", "local")  # the compression stage's steps (see the module doc)
PAPER_BASELINES = ("lamb", "adamw", "onebit_lamb", "onebit_adam")  # the baselines the SLAMB authors' code runs

# Per-GPU training throughput, samples/s, mixed precision: (figure, where it comes from).
PUBLISHED = {
    ("bert", "a100"): (580.0, "NVIDIA's published figure: BERT-Large phase 1 (seq 128) on 1x A100-80G, mixed "
                              "precision, NVIDIA DeepLearningExamples PyTorch BERT README (21.11 container)"),
    ("bert", "v100"): (224.0, "NVIDIA's published figure: BERT-Large phase 1 (seq 128) on 1x V100-32G, mixed "
                              "precision, NVIDIA DeepLearningExamples PyTorch BERT README (21.11 container)"),
    ("swin", "v100"): (278.0 / 3, "derived: Swin-B's 278 img/s V100 INFERENCE figure (Liu et al. 2021, Table 1) "
                                  "/ 3 (a training step is ~3x the forward FLOPs); no published A100 figure"),
}
PAPER = {  # the SLAMB paper's abstract (Xu et al., ICML 2023)
    "bert_xl_efficiency": 0.90,  # BERT-XL (2.8B) on 1,024 A100s at 90 % scaling efficiency
    "swin_hours": 5.35, "swin_gpus": 128, "swin_hours_saved": 2.0,  # Swin-B on ImageNet in 5.35 h, 2 h faster
    "bert_data_ratio": 0.5,  # "transmits half the amount of data" of the state of the art (1-bit LAMB)
}


@dataclass(frozen=True)
class Target:
    key: str
    label: str
    family: str  # "bert" | "swin": which published throughput
    params: int
    global_batch: int | None = None  # fixed global batch (strong scaling) ...
    batch_per_gpu: int | None = None  # ... or a fixed batch per GPU (weak scaling)

    def per_gpu(self, gpus: int) -> float:
        return self.global_batch / gpus if self.global_batch else self.batch_per_gpu


def targets() -> list[Target]:
    """The paper's models with their parameter counts from our builders (on the meta device)."""
    import timm
    from transformers import BertForPreTraining

    from models import build_bert_config

    def count(build) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in build().parameters())

    bert = lambda size: count(lambda: BertForPreTraining(build_bert_config(size)))  # noqa: E731
    swin = count(lambda: timm.create_model("swin_base_patch4_window7_224"))
    return [Target("bert_large", "BERT-Large", "bert", bert("large"), global_batch=65536),
            Target("bert_xl", "BERT-XL", "bert", bert("xl"), global_batch=65536),
            Target("swin_base", "Swin-B", "swin", swin, batch_per_gpu=128)]


# ------------------------------------------------------------------------------------------ communication profile
Call = tuple[str, float]  # (collective kind, bytes per parameter; an all-gather's: gathered bytes per parameter)


@dataclass
class Profile:
    """What one optimizer sends per step, by step kind, in bytes per parameter of the model."""

    steps: dict[str, list[list[Call]]]  # step kind -> the recorded steps of that kind -> their calls
    schedule: list[str]  # step kinds of the schedule the average is over
    steady: list[str]  # step kinds of the compression stage
    bucket_bytes: int | None  # the optimizer's all-reduce bucket size (None: one call per recorded call)
    scale: float = 1.0  # measured / built-in bits (--runs)


def _cycle(name: str, options: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """(settings for the tiny run, kind of each step to run, the schedule's step kinds) of optimizer `name`."""
    if name in ONEBIT_LABELS:
        settings, kinds = stage_kinds(ONEBIT_LABELS[name], 1)
        return settings, kinds, phase1_schedules()[name][1]
    steps = options.get("sync_interval") or (20 if get_optimizer_spec(name).samples_layers else 1)
    return {}, ["cycle"] * steps, ["cycle"]


def measure_profile(name: str, wire: str) -> Profile:
    """Step optimizer `name` (its conf/optim YAML, full-precision payloads in `wire`) through one cycle of its
    schedule on the tiny BERT."""
    options = config_kwargs(name)
    options |= {key: wire for key in ("comm_dtype", "dense_comm_dtype") if key in options}
    bucket_mb = options.get("bucket_mb")
    if get_optimizer_spec(name).grad_sync == "ddp":
        wire_bytes = torch.tensor([], dtype=WIRE_DTYPES[wire]).element_size()
        return Profile({"cycle": [[("all_reduce", float(wire_bytes))]]}, ["cycle"], ["cycle"], DDP_BUCKET_BYTES)
    settings, kinds, schedule = _cycle(name, options)
    model = bert_parameters("tiny", torch.device("cpu"))
    numel = sum(p.numel() for p in model.parameters())
    comm = MirrorComm(MEASURE_WORLD)
    optimizer = build_optimizer(model, name, options | settings, comm=comm)
    step = optimizer_stepper(name, optimizer, {p: p.grad for p in model.parameters()}, lambda: 0.0)
    steps: dict[str, list[list[Call]]] = defaultdict(list)
    for kind in kinds:
        comm.calls.clear()
        step()
        steps[kind].append([(k, b * (MEASURE_WORLD if k == "all_gather" else 1) / numel) for k, b in comm.calls])
    missing = set(schedule) - set(steps)
    if missing:
        raise RuntimeError(f"{name}: the tiny run visited no step of kind {sorted(missing)}")
    steady = [k for k in schedule if k in STEADY_KINDS]
    return Profile(dict(steps), schedule, steady, int(bucket_mb * 2**20) if bucket_mb else None)


def _step_cost(calls: list[Call], params: int, gpus: int, cluster: Cluster, bucket_bytes: int | None,
               scale: float) -> tuple[float, float, int]:
    """(seconds, bytes this rank sends, collectives) of one recorded step scaled to `params` on `gpus` ranks."""
    seconds = sent = 0.0
    count = 0
    for kind, per_param in calls:
        total = per_param * params * scale
        nbytes = total / gpus if kind == "all_gather" else total
        pieces = max(1, math.ceil(nbytes / bucket_bytes)) if bucket_bytes and kind == "all_reduce" else 1
        seconds += pieces * collective_seconds(kind, nbytes / pieces, gpus, cluster)
        sent += nbytes
        count += pieces
    return seconds, sent, count


def comm_cost(profile: Profile, kinds: list[str], params: int, gpus: int, cluster: Cluster) -> dict[str, float]:
    """Mean seconds, bits per parameter and collectives per step over the step kinds `kinds` (a schedule)."""
    per_kind = {}
    for kind in set(kinds):
        costs = [_step_cost(calls, params, gpus, cluster, profile.bucket_bytes, profile.scale)
                 for calls in profile.steps[kind]]
        per_kind[kind] = [sum(c[i] for c in costs) / len(costs) for i in range(3)]
    mean = [sum(per_kind[k][i] for k in kinds) / len(kinds) for i in range(3)]
    return {"comm_s": mean[0], "bits_per_param": 8 * mean[1] / params, "collectives": mean[2]}


# ------------------------------------------------------------------------------------------ measured runs
def read_runs(run_dirs: list[Path]) -> dict[str, tuple[float, int]]:
    """optimizer -> (bits per parameter per step, world size) from runs' summary.json; a run that cannot tell them
    is a `UserError` naming it (the study would otherwise quietly fall back to the built-in profile)."""
    measured = {}
    for run_dir in run_dirs:
        path = RunDir(run_dir).summary_file
        if not path.is_file():
            raise UserError(f"--runs {run_dir}: no {path.name} there (not a finished run directory)")
        try:
            summary = json.loads(path.read_text())
            measured[str(summary["optimizer"])] = (float(summary["bits_per_param_per_step"]),
                                                   int(summary["world_size"]))
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(f"--runs {run_dir}: {path} does not hold a run's summary ({err!r})") from None
    return measured


# ------------------------------------------------------------------------------------------ the study
def throughput_per_gpu(target: Target, gpu: str, given: dict[str, float], bert_large_params: int) -> tuple[float, str]:
    """Samples/s of one GPU computing a step of `target`, and where the figure comes from."""
    if target.key in given:
        return given[target.key], "measured (--throughput)"
    if target.family == "swin":
        return PUBLISHED["swin", "v100"]
    figure, source = PUBLISHED["bert", gpu]
    if target.key == "bert_large":
        return figure, source
    return figure * bert_large_params / target.params, f"BERT-Large's figure x {bert_large_params / 1e6:.0f}M / " \
        f"{target.params / 1e6:.0f}M parameters (FLOPs 6 x params x tokens) [{source}]"


def study(args: argparse.Namespace, measured: dict[str, tuple[float, int]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows (model, optimizer, GPUs) of the model's figures, and the printed report; `measured`: `read_runs`."""
    cluster = Cluster(LINKS[args.network], GPUS_PER_NODE, LINKS[args.nvlink])
    models = targets()
    bert_large = next(t for t in models if t.key == "bert_large").params
    profiles = {name: measure_profile(name, args.wire) for name in args.optimizers}
    lines = [f"network: {args.network} between nodes of {GPUS_PER_NODE} GPUs over {args.nvlink} (nominal rates, "
             "optim/network.py); no compute/communication overlap",
             f"communication: measured on a tiny BERT as {MEASURE_WORLD} ranks, scaled by parameter count"]
    for name, (bits, world) in measured.items():
        if name in profiles:
            built_in = comm_cost(profiles[name], profiles[name].schedule, bert_large, world, cluster)
            profiles[name].scale = bits / built_in["bits_per_param"]
            lines.append(f"--runs: {name} measured {bits:.3f} bits/param/step on {world} ranks; built-in "
                         f"{built_in['bits_per_param']:.3f}: its bytes scaled by {profiles[name].scale:.3f}")
    rows = []
    for target in models:
        thr, source = throughput_per_gpu(target, args.gpu, args.throughput, bert_large)
        lines += ["", f"## {target.label} ({target.params / 1e6:.0f}M parameters), {thr:.1f} samples/s per GPU: "
                  f"{source}; " + (f"global batch {target.global_batch}" if target.global_batch else
                                   f"{target.batch_per_gpu} per GPU"),
                  f"{'optimizer':<18} {'bits/p steady':>13} {'bits/p sched':>12} {'coll/step':>9}  "
                  + " ".join(f"{g:>14}" for g in args.gpus),
                  f"{'':<18} {'':>13} {'':>12} {'':>9}  " + " ".join(f"{'k/s eff%':>14}" for _ in args.gpus)]
        for name, profile in profiles.items():
            cells = []
            for gpus in args.gpus:
                compute = target.per_gpu(gpus) / thr
                steady = comm_cost(profile, profile.steady, target.params, gpus, cluster)
                sched = comm_cost(profile, profile.schedule, target.params, gpus, cluster)
                step = compute + sched["comm_s"]
                row = dict(model=target.key, optimizer=name, gpus=gpus, network=args.network, compute_s=compute,
                           comm_s=sched["comm_s"], step_s=step, samples_per_s=gpus * target.per_gpu(gpus) / step,
                           efficiency=compute / step, efficiency_steady=compute / (compute + steady["comm_s"]),
                           bits_per_param=sched["bits_per_param"], bits_per_param_steady=steady["bits_per_param"],
                           collectives_per_step=sched["collectives"])
                rows.append(row)
                cells.append(f"{row['samples_per_s'] / 1e3:>8.1f} {100 * row['efficiency']:>5.1f}")
            first = next(r for r in rows if r["model"] == target.key and r["optimizer"] == name)
            lines.append(f"{name:<18} {first['bits_per_param_steady']:>13.3f} {first['bits_per_param']:>12.3f} "
                         f"{first['collectives_per_step']:>9.2f}  " + " ".join(cells))
        lines.append(f"(bits/param and collectives per step at {args.gpus[0]} GPUs; sched: averaged over the "
                     "schedule, warm-up included; k/s: thousand samples/s from the schedule average)")
    return rows, [*lines, "", *paper_claims(rows, args)]


def paper_claims(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """The paper's three headline claims beside the model's own figures."""
    def row(model: str, optimizer: str, gpus: int) -> dict[str, Any] | None:
        return next((r for r in rows if (r["model"], r["optimizer"], r["gpus"]) == (model, optimizer, gpus)), None)

    lines = ["## the paper's claims (SLAMB, ICML 2023 abstract) beside the model's figures; the Swin baselines are "
             f"those the authors' code runs: {', '.join(PAPER_BASELINES)}"]
    xl = row("bert_xl", "slamb", 1024)
    if xl:
        model, paper = 100 * xl["efficiency"], 100 * PAPER["bert_xl_efficiency"]
        lines.append(f"BERT-XL, SLAMB, 1,024 GPUs: scaling efficiency paper {paper:.0f} % | model {model:.1f} % | "
                     f"difference {model - paper:+.1f} points")
    gpus = PAPER["swin_gpus"]
    swin = {r["optimizer"]: SWIN_EPOCHS * IMAGENET_TRAIN_IMAGES / r["samples_per_s"] / 3600
            for r in rows if r["model"] == "swin_base" and r["gpus"] == gpus}
    baselines = {name: hours for name, hours in swin.items() if name in PAPER_BASELINES}
    if "slamb" in swin and baselines:
        best = min(baselines, key=baselines.get)
        saved = baselines[best] - swin["slamb"]
        lines.append(f"Swin-B, {gpus} GPUs, {SWIN_EPOCHS} epochs of ImageNet-1k: SLAMB paper {PAPER['swin_hours']} h | "
                     f"model {swin['slamb']:.2f} h | difference {swin['slamb'] - PAPER['swin_hours']:+.2f} h; faster "
                     f"than the best baseline by: paper {PAPER['swin_hours_saved']:.0f} h | model {saved:.2f} h "
                     f"(best baseline: {best}, {baselines[best]:.2f} h) | difference "
                     f"{saved - PAPER['swin_hours_saved']:+.2f} h")
    gpus = args.gpus[-1]
    slamb, onebit = row("bert_large", "slamb", gpus), row("bert_large", "onebit_lamb", gpus)
    if slamb and onebit:
        ratio = slamb["bits_per_param"] / onebit["bits_per_param"]
        lines.append(f"BERT-Large, data sent by SLAMB / 1-bit LAMB (bits/param/step over phase 1, {gpus} GPUs): "
                     f"paper {PAPER['bert_data_ratio']} | model {ratio:.3f} ({slamb['bits_per_param']:.3f} / "
                     f"{onebit['bits_per_param']:.3f}) | difference {ratio - PAPER['bert_data_ratio']:+.3f} "
                     f"(full-precision payloads in {args.wire}: --wire)")
    return lines


THROUGHPUT_KEYS = ("bert_large", "bert_xl", "swin_base")  # the keys of targets()


def _throughputs(pairs: list[str], json_file: str | None) -> dict[str, float]:
    """--throughput MODEL=SAMPLES_PER_S pairs over --throughput-json's object; a bad one is a `UserError`."""
    given: dict[str, object] = {}
    if json_file:
        try:
            given = json.loads(Path(json_file).read_text())
        except ValueError as err:
            raise UserError(f"--throughput-json {json_file}: not JSON ({err})") from None
        if not isinstance(given, dict):
            raise UserError(f"--throughput-json {json_file}: must hold an object such as {{\"bert_large\": 600}}")
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals:
            raise UserError(f"--throughput {pair}: must be MODEL=SAMPLES_PER_S, e.g. bert_large=600")
        given[key] = value
    throughputs = {}
    for key, value in given.items():
        if key not in THROUGHPUT_KEYS:
            raise UserError(f"--throughput {key}: unknown model; choose from {', '.join(THROUGHPUT_KEYS)}")
        try:
            figure = float(value)
        except (TypeError, ValueError):
            figure = math.nan
        if not 0 < figure < math.inf:
            raise UserError(f"--throughput {key}={value}: must be a positive number of samples per second")
        throughputs[key] = figure
    return throughputs


def check_args(args: argparse.Namespace) -> None:
    """The values argparse cannot check: GPU counts and optimizer names."""
    bad = [g for g in args.gpus if g < 1]
    if bad:
        raise UserError(f"--gpus {' '.join(map(str, bad))}: GPU counts must be >= 1")
    runnable = runnable_optimizers()
    unknown = [name for name in args.optimizers if name not in runnable]
    if unknown:
        raise UserError(f"--optimizers {' '.join(unknown)}: not runnable here; choose from {', '.join(runnable)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=NETWORKS, default="ib100",
                        help="between nodes (default ib100: the paper's interconnect is not stated in its abstract)")
    parser.add_argument("--nvlink", choices=NVLINKS, default=None, help="inside a node (default: the --gpu's)")
    parser.add_argument("--gpu", choices=["a100", "v100"], default="a100",
                        help="published throughput and NVLink generation (the paper's BERT-XL run: A100)")
    parser.add_argument("--gpus", nargs="+", type=int, default=list(GPU_COUNTS))
    parser.add_argument("--optimizers", nargs="+", default=None, help="registry names (default: all runnable here)")
    parser.add_argument("--wire", choices=list(WIRE_DTYPES), default="fp16",
                        help="dtype of every full-precision payload: DDP gradients (trainer.grad_allreduce_dtype), "
                             "SLAMB's momentum (optim.comm_dtype), the 1-bit family's warm-up "
                             "(optim.dense_comm_dtype); default fp16, as the BERT runs of the paper and its "
                             "baselines sent")
    parser.add_argument("--throughput", nargs="*", default=[], metavar="MODEL=SAMPLES_PER_S",
                        help="measured per-GPU training throughput (bert_large, bert_xl, swin_base)")
    parser.add_argument("--throughput-json", help="a JSON object of the same: {\"bert_large\": 600}")
    parser.add_argument("--runs", nargs="*", default=[], type=Path, help="run directories with a summary.json")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path, help="scaling efficiency against GPUs, a panel per model")
    args = parser.parse_args(argv)
    with user_errors_exit():
        args.nvlink = args.nvlink or {"a100": "nvlink3", "v100": "nvlink2"}[args.gpu]
        args.throughput = _throughputs(args.throughput, args.throughput_json)
        args.optimizers = args.optimizers or runnable_optimizers()
        check_args(args)
        measured = read_runs(args.runs)
        torch.manual_seed(0)
        rows, lines = study(args, measured)
        write_outputs(args, rows, lines)


def write_outputs(args: argparse.Namespace, rows: list[dict[str, Any]], lines: list[str]) -> None:
    """The report on stdout, then the files asked for."""
    sys.stdout.write("\n".join(lines) + "\n")
    if args.csv:
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(args.csv, table.getvalue())
    if args.json:
        atomic_write_text(args.json, json.dumps(rows, indent=1))
    if args.png:
        from benchmarks.paper.plots import write_scaling_plot  # matplotlib only when a plot is asked for

        write_scaling_plot(rows, args.png)


if __name__ == "__main__":
    main()
