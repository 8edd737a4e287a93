"""The paper's accuracy claim at a chosen scale: BERT validation loss of every optimizer at equal steps, with seeds.

    python -m benchmarks.paper.convergence                       # CPU: tiny BERT, python_docs, 4 gloo ranks, ~3.5 h
    python -m benchmarks.paper.convergence --variants lamb slamb --seeds 3
    python -m benchmarks.paper.convergence --gpus 8 --size base --steps 5000 --seeds 3 --override precision=bf16
    python -m benchmarks.paper.convergence --report-only --out runs/convergence     # the page again, from the data

Every variant (an optimizer with its BERT preset, or a setting under study) pretrains BERT once per seed on the
prepared `python_docs` corpus with the same data, schedule, global batch and number of steps, and is evaluated on
the corpus's held-out split (documents no run trains on) at 25, 50, 75 and 100 % of the run. The seed sets the
data order, the initial weights, dropout and the optimizers' own draws (SLAMB's masks, JointSpar's layers); the
held-out set is the same for every run, so runs of one seed are pairs. LAMB and SLAMB's preset run 3 seeds, the
other variants 2 (`--seeds`, `--seeds-for`). Each pretrained model is then fine-tuned on the shipped SQuAD-format
file (`experiment=squad_demo`: 24 questions, a smoke test of what pretraining gives downstream, not SQuAD v1.1).

A variant that sends 16-bit values (`WIRE_KEYS`) has one more run, seed 0 with every payload in fp32, whose bytes
are its bits at 32 bits per value (bytes do not depend on the seed); the page sets every variant against LAMB both
as sent and at 32 bits.

Writes to `--out`: `runs.jsonl.gz` (every run's steps, losses and bytes: `benchmarks.paper.convergence_data`), the
page rendered from it (`--page`, from `--template`: `benchmarks.paper.convergence_page`) and its figures. Every run
is an ordinary `python -m train` run under `--out`, so rerunning resumes the study; `--report-only` renders the
page from the data alone.

The variants beyond the optimizers measure the settings a gap could come from: LAMB with its gradients all-reduced
in fp16 (NVIDIA's recipe) and with SLAMB's rule for biases and LayerNorm (`always_adapt=true`); SLAMB's beta3 and
sync interval H (the official advice is to fix k and tune beta3), its mask (this project's stratified rows against
the paper's Bernoulli coordinates) and NVLAMB's rule (`always_adapt=false`); 1-bit LAMB at LAMB's LR, with and
without its published coefficient bound; 1-bit Adam's and 0/1 Adam's warm-up (the variance frozen at 40 % of the
run instead of 20 %); AdamW at 1-bit Adam's LR (1e-3; the AdamW preset's 1e-4 is BERT's Adam LR at batch 256);
SlowMo averaging twice as often; JointSpar sampling every layer (sample_ratio 1).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from benchmarks.common import REPO
from benchmarks.paper import stages
from benchmarks.paper.convergence_data import DATA_NAME, Point, RunData, StudyData
from benchmarks.paper.convergence_page import DEFAULT_TEMPLATE, REFERENCE, Results, write_figures
from core.atomic import atomic_write_text
from core.errors import UserError, user_errors_exit
from optim.apex import runnable_optimizers
from train.metrics import read_metrics
from train.run_dir import RunDir
from train.subprocess_stage import override, stage_stops_exit
from train.summary import VALIDATION_LOSS

# The keys that send values in 16 bits when set so; a variant's fp32 run sets them all to fp32.
WIRE_KEYS = ("trainer.grad_allreduce_dtype", "optim.comm_dtype", "optim.dense_comm_dtype")


@dataclass(frozen=True)
class Variant:
    """One line of the study: an optimizer (with its BERT preset) and the settings that set it apart."""

    label: str
    optimizer: str
    overrides: tuple[str, ...] = ()

    def slug(self) -> str:
        return re.sub(r"[^\w.-]+", "_", self.label)


def _warmup(key: str, fraction: float):
    return lambda steps: (f"optim.{key}={max(2, round(fraction * steps))}",)


def _slowmo_half_period(steps: int) -> tuple[str, ...]:
    """SlowMo averaging twice as often as the study's scaled period."""
    (scaled,) = stages.schedule_overrides("slowmo", steps)
    return (f"optim.sync_interval={max(1, int(scaled.rpartition('=')[2]) // 2)}",)


# Settings a gap could come from, each one change from a preset (callables: counted in steps, scaled to the run).
SETTINGS: dict[str, tuple[str, Any]] = {  # in the order they run: the pairing and the official advice first
    "lamb allreduce=fp16": ("lamb", ("trainer.grad_allreduce_dtype=fp16",)),  # NVIDIA's recipe's all-reduce
    "lamb always_adapt=true": ("lamb", ("optim.always_adapt=true",)),  # SLAMB's rule for biases and LayerNorm
    "slamb always_adapt=false": ("slamb", ("optim.always_adapt=false",)),
    "slamb beta3=0.93": ("slamb", ("optim.beta3=0.93",)),  # the value once quoted for the paper
    "slamb mask=bernoulli": ("slamb", ("optim.mask=bernoulli",)),
    "slamb H=20": ("slamb", ("optim.sync_interval=20",)),
    "onebit_lamb lr=6e-3": ("onebit_lamb", ("optim.lr=6.0e-3",)),  # LAMB's LR, the published bound 0.3
    "onebit_lamb lr=6e-3 max_coeff=10": ("onebit_lamb", ("optim.lr=6.0e-3", "optim.max_coeff=10.0")),  # DeepSpeed's
    "onebit_adam warm-up x2": ("onebit_adam", _warmup("freeze_step", 0.4)),  # frozen at 40 % of the run, not 20 %
    "zero_one_adam warm-up x2": ("zero_one_adam", _warmup("var_freeze_step", 0.4)),
    "adamw lr=1e-3": ("adamw", ("optim.lr=1.0e-3",)),  # 1-bit Adam's LR: its gap to AdamW is then compression's
    "slowmo tau/2": ("slowmo", _slowmo_half_period),
    "jointspar sample_ratio=1": ("jointspar", ("optim.sample_ratio=1.0",)),  # every layer: LAMB with its bookkeeping
    "slamb beta3=0.93 H=20": ("slamb", ("optim.beta3=0.93", "optim.sync_interval=20")),
}
# LARS is a vision optimizer (SlowMo's base for Swin): the BERT study leaves it out unless asked for.
NOT_BY_DEFAULT = ("lars",)
MORE_SEEDS = ("lamb=3", "slamb=3")  # the pair the headline claim is about


def default_variants() -> list[str]:
    return [name for name in runnable_optimizers() if name not in NOT_BY_DEFAULT] + list(SETTINGS)


def build_variant(label: str, steps: int) -> Variant:
    if label in SETTINGS:
        optimizer, settings = SETTINGS[label]
        return Variant(label, optimizer, tuple(settings(steps) if callable(settings) else settings))
    return Variant(label, label)


SEEDED = ("slamb", "slamb_v2_official", "jointspar")  # optimizers with a seed of their own (conf/optim/*.yaml)


class ConvergenceStudy:
    """The runs of one study, their commands and where their results land."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        logging = ["logger.progress_bar=false", "logger.tensorboard=false", "logger.wandb=disabled"]
        self.device = ["trainer.device=cuda" if args.gpus else "trainer.device=cpu"]
        self.common = [*logging, *self.device]
        self.variants = [build_variant(label, args.steps) for label in args.variants]

    def seeds(self, variant: Variant) -> range:
        return range(self.args.seeds_for.get(variant.label, self.args.seeds))

    def bert_dir(self, variant: Variant, seed: int, fp32: bool = False) -> Path:
        return self.out / "bert" / variant.slug() / f"{'fp32_' if fp32 else ''}seed{seed}"

    def squad_dir(self, variant: Variant, seed: int) -> Path:
        return self.out / "squad" / variant.slug() / f"seed{seed}"

    def bert_command(self, variant: Variant, seed: int, fp32: tuple[str, ...] = ()) -> list[str]:
        """The run of `variant` with `seed`; `fp32`: the wire keys its fp32 run sets to fp32."""
        a, steps = self.args, self.args.steps
        eval_every = max(1, steps // 4)
        log_every = math.gcd(eval_every, max(1, steps // 50))  # a training record (with bytes) at every eval
        own_seed = [f"optim.seed={seed}"] if variant.optimizer in SEEDED else []
        name = f"convergence_{variant.slug()}_{'fp32_' if fp32 else ''}seed{seed}"
        return [stages.optimizer_choice(variant.optimizer), f"name={name}",
                f"model=bert_{a.size}", *stages.corpus_overrides(a.corpus, a.corpus_path),
                f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}", f"trainer.log_every={log_every}",
                f"trainer.seed={seed}", *own_seed, "trainer.checkpoint_every=0",
                *stages.schedule_overrides(variant.optimizer, steps), *variant.overrides, *self.common,
                f"trainer.nproc_per_node={a.gpus or a.ranks}", *a.override, *(f"{key}=fp32" for key in fp32),
                override("hydra.run.dir", self.bert_dir(variant, seed, fp32=bool(fp32)))]

    def squad_command(self, variant: Variant, seed: int) -> list[str]:
        weights = RunDir(self.bert_dir(variant, seed)).export_dir
        return stages.squad_overrides(weights, f"convergence_squad_{variant.slug()}_seed{seed}", self.args.squad_epochs,
                               self.common, self.squad_dir(variant, seed))

    def half_precision_keys(self, variant: Variant) -> tuple[str, ...]:
        """The `WIRE_KEYS` the variant's seed-0 run (recorded) set to a 16-bit dtype."""
        recorded = RunDir(self.bert_dir(variant, 0)).recorded_config()
        return tuple(key for key in WIRE_KEYS
                     if recorded is not None and OmegaConf.select(recorded, key) not in (None, "fp32"))

    def run_data(self, variant: Variant, seed: int) -> RunData:
        """One run's record for the study's data file."""
        run_dir = self.bert_dir(variant, seed)
        summary = stages.read_summary(run_dir)
        fp32_keys = self.half_precision_keys(variant)
        at_fp32 = stages.read_summary(self.bert_dir(variant, 0, fp32=True)) if fp32_keys else summary
        squad = stages.read_summary(self.squad_dir(variant, seed))["best"]["eval/f1"] if self.args.squad_epochs \
            else None
        return RunData(variant.label, variant.optimizer, seed, points(run_dir), variant.overrides,
                       summary["bits_per_param_per_step"], at_fp32["bits_per_param_per_step"],
                       summary.get("replica_average_bits_per_param_per_step"), summary["elapsed_seconds"], squad)


def points(run_dir: Path) -> tuple[Point, ...]:
    """(step, training loss, validation loss, bytes sent per rank by then) of every record of a run."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_metrics(run_dir):
        fields = by_step.setdefault(record["step"], {})
        if "loss" in record:
            fields.update(train_loss=record["loss"], bytes_total=record.get("comm_bytes_total"))
        if VALIDATION_LOSS in record:
            fields["val_loss"] = record[VALIDATION_LOSS]
    return tuple(Point(step, **fields) for step, fields in sorted(by_step.items()))


def study_meta(study: ConvergenceStudy, runs: list[RunData]) -> dict[str, Any]:
    """What the page says of how the runs were made: date, commit, command, set-up, device, torch."""
    a = study.args
    first = stages.read_summary(study.bert_dir(study.variants[0], 0))
    workers = f"{a.gpus} GPU(s)" if a.gpus else f"{a.ranks} CPU rank(s)"
    return {"date": datetime.datetime.now(datetime.UTC).date().isoformat(), "commit": _commit(),
            "command": " ".join(["python -m benchmarks.paper.convergence", *map(_quoted, sys.argv[1:])]),
            "size": a.size, "steps": a.steps, "corpus": a.corpus, "workers": workers,
            "seeds": {v.label: len(study.seeds(v)) for v in study.variants},
            "device": first.get("device"), "torch": first.get("torch_version"),
            "wall": f"{sum(run.wall_seconds for run in runs) / 60:.0f} min of pretraining: the runs' training clocks "
                    "summed (their evaluations included; start-up, fine-tuning and the fp32 runs not)"}


def _commit() -> str:
    """The checkout's commit, "+changes" when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "-uno") else "")


def _quoted(arg: str) -> str:
    return f'"{arg}"' if " " in arg else arg


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Every run is a `python -m train` run; rerunning resumes.")
    parser.add_argument("--out", type=Path, default=Path("runs/convergence"),
                        help=f"where the runs, {DATA_NAME} and the figures go")
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"optimizers and settings (default: every runnable optimizer but "
                             f"{', '.join(NOT_BY_DEFAULT)}, then: {'; '.join(SETTINGS)})")
    parser.add_argument("--seeds", type=int, default=2, help="runs per variant, seeds 0, 1, ...")
    parser.add_argument("--seeds-for", nargs="*", default=list(MORE_SEEDS), metavar="VARIANT=N",
                        help=f"variants with another number of seeds (default: {' '.join(MORE_SEEDS)})")
    parser.add_argument("--size", choices=["tiny", "base", "large", "xl"], default="tiny", help="BERT size")
    parser.add_argument("--steps", type=int, default=300, help="pretraining steps, the same for every run")
    parser.add_argument("--corpus", choices=["python_docs", "demo"], default="python_docs",
                        help="demo: the embedded corpus and its held-out split (a quick look, not a study)")
    parser.add_argument("--corpus-path", type=Path, default=stages.PYTHON_DOCS, help="the prepared python_docs corpus")
    parser.add_argument("--ranks", type=int, default=4, help="CPU processes (gloo) per run")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per run (NCCL); replaces --ranks")
    parser.add_argument("--squad-epochs", type=int, default=10, help="0: no SQuAD fine-tuning")
    parser.add_argument("--override", action="append", default=[], help="extra override of the pretraining runs "
                        "(repeatable), e.g. --override precision=bf16")
    parser.add_argument("--report-only", action="store_true",
                        help=f"run nothing: render the page and figures from --out's {DATA_NAME}")
    parser.add_argument("--page", type=Path, default=None, help="the page to write (default: --out/convergence.md)")
    parser.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE,
                        help="the page's template ({{ expression }} placeholders: benchmarks.paper.convergence_page)")
    args = parser.parse_args(argv)
    args.page = args.page or args.out / "convergence.md"
    if args.report_only:
        return args
    args.variants = args.variants or default_variants()
    runnable = runnable_optimizers()
    unknown = [v for v in args.variants if v not in SETTINGS and v not in runnable]
    if unknown:
        raise UserError(f"--variants {' '.join(unknown)}: not runnable here; choose from "
                        f"{', '.join(runnable)} or a setting: {'; '.join(SETTINGS)}")
    if REFERENCE not in args.variants:
        raise UserError(f"--variants must include {REFERENCE}: every difference is measured against it")
    args.seeds_for = _seeds_for(args.seeds_for, args.variants)
    for flag in ("steps", "ranks", "seeds"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    return args


def _seeds_for(items: list[str], variants: list[str]) -> dict[str, int]:
    """`VARIANT=N` items as {variant: N}, for the study's variants (a label may hold "=": the last one splits)."""
    seeds = {}
    for item in items:
        label, _, count = item.rpartition("=")
        if not count.isdigit() or int(count) < 1:
            raise UserError(f"--seeds-for {item}: give VARIANT=N with N >= 1")
        seeds[label] = int(count)
    return {label: count for label, count in seeds.items() if label in variants}


def run_study(args: argparse.Namespace) -> None:
    """Every run (a variant's seeds together, the optimizers before the settings), then the data and the page."""
    study = ConvergenceStudy(args)
    if args.corpus == "python_docs":
        stages.prepare_corpus(args.corpus_path)
    workers = f"{args.gpus} GPU(s)" if args.gpus else f"{args.ranks} CPU rank(s)"
    print(f"convergence study in {study.out}: BERT-{args.size}, {args.steps} steps, {workers}, "
          f"{len(study.variants)} variants x {args.seeds} seeds (more: {args.seeds_for}); SQuAD "
          f"{args.squad_epochs} epochs", flush=True)
    start = time.perf_counter()
    for variant in study.variants:  # the optimizers first, each with all its seeds: a cut study still compares
        for seed in study.seeds(variant):
            stages.train(f"bert  {variant.label} seed {seed}", study.bert_command(variant, seed),
                         study.bert_dir(variant, seed))
            if args.squad_epochs:
                stages.train(f"squad {variant.label} seed {seed}", study.squad_command(variant, seed),
                             study.squad_dir(variant, seed))
        fp32_keys = study.half_precision_keys(variant)
        if fp32_keys:  # its bytes with every value at 32 bits
            stages.train(f"bert  {variant.label} fp32", study.bert_command(variant, 0, fp32_keys),
                         study.bert_dir(variant, 0, fp32=True))
    runs = [study.run_data(variant, seed) for variant in study.variants for seed in study.seeds(variant)]
    StudyData(study_meta(study, runs), runs).write(study.out / DATA_NAME)
    render(args)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min: {args.page}")


def render(args: argparse.Namespace) -> None:
    """The page (from its template) and the figures, from --out's data alone."""
    out = args.out.resolve()
    results = Results(StudyData.read(out / DATA_NAME))
    if not args.template.is_file():
        raise UserError(f"--template {args.template} does not exist")
    figures = write_figures(results, out)
    folder = Path(os.path.relpath(out, args.page.resolve().parent)).as_posix()  # the figures' links from the page
    atomic_write_text(args.page, results.render(args.template.read_text(), figures=folder))
    print(f"{args.page}: rendered from {out / DATA_NAME}; figures: {', '.join(p.name for p in figures)}")


def main(argv: list[str] | None = None) -> None:
    with user_errors_exit(), stage_stops_exit():
        args = parse_args(argv)
        if args.report_only:
            render(args)
        else:
            run_study(args)


if __name__ == "__main__":
    main()
