"""The paper's accuracy claim at a chosen scale: BERT validation loss of every optimizer at equal steps, with seeds.

    python -m benchmarks.paper.convergence                       # CPU: tiny BERT, python_docs, 4 gloo ranks, ~2 h
    python -m benchmarks.paper.convergence --variants lamb slamb --seeds 3
    python -m benchmarks.paper.convergence --gpus 8 --size base --steps 5000 --seeds 3 --override precision=bf16

Every variant (an optimizer with its BERT preset, or a setting under study) pretrains BERT once per seed on the
prepared `python_docs` corpus with the same data, schedule, global batch and number of steps, and is evaluated on
the corpus's held-out split (documents no run trains on) at 25, 50, 75 and 100 % of the run. The seed sets the
data order, the initial weights, dropout and the optimizers' own draws (SLAMB's masks, JointSpar's layers); the
held-out set is the same for every run. Each pretrained model is then fine-tuned on the shipped SQuAD-format file
(`experiment=squad_demo`: 24 questions, a smoke test of what pretraining gives downstream, not SQuAD v1.1).

Writes to `--out`: `convergence.md` / `convergence.csv` (per variant: the validation loss at each quarter as the
mean over seeds, each seed's final value, the difference to LAMB's mean in units of its standard error, bits per
parameter per step, wall time, SQuAD F1) and `val_loss_vs_step.png` / `val_loss_vs_bytes.png` (the seeds' mean,
their range shaded). Every run is an ordinary `python -m train` run under `--out`, so rerunning resumes the study.

The variants beyond the optimizers measure the settings a gap could come from: SLAMB's beta3 and sync interval H
(the official advice is to fix k and tune beta3), its mask (this project's stratified rows against the paper's
Bernoulli coordinates), its rule for biases and LayerNorm (`always_adapt=false`: NVLAMB's plain Adam steps, as
`optim=lamb` gives them), 1-bit Adam's warm-up length (its variance frozen at 40 % of the run instead of 20 %) and
AdamW at 1-bit Adam's LR (1e-3; the AdamW preset's 1e-4 is BERT's Adam LR at batch 256).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import csv_table, markdown_table, runnable_optimizers
from benchmarks.paper import stages
from core.atomic import atomic_write_text
from core.errors import UserError, user_errors_exit
from train.metrics import read_metrics
from train.run_dir import RunDir
from train.subprocess_stage import override, stage_stops_exit
from train.summary import VALIDATION_LOSS

REFERENCE = "lamb"  # the baseline every difference is measured against (NVLAMB, as in NVIDIA's recipe)


@dataclass(frozen=True)
class Variant:
    """One line of the study: an optimizer (with its BERT preset) and the settings that set it apart."""

    label: str
    optimizer: str
    overrides: tuple[str, ...] = ()

    def slug(self) -> str:
        return re.sub(r"[^\w.-]+", "_", self.label)


def _onebit_warmup(fraction: float):
    return lambda steps: (f"optim.freeze_step={max(2, round(fraction * steps))}",)


# Settings a gap could come from, each one change from a preset (callables: counted in steps, scaled to the run).
SETTINGS: dict[str, tuple[str, Any]] = {  # in the order they run: the pairing and the official advice first
    "slamb always_adapt=false": ("slamb", ("optim.always_adapt=false",)),
    "slamb beta3=0.93": ("slamb", ("optim.beta3=0.93",)),  # the value once quoted for the paper
    "slamb mask=bernoulli": ("slamb", ("optim.mask=bernoulli",)),
    "slamb H=20": ("slamb", ("optim.sync_interval=20",)),
    "onebit_adam warm-up x2": ("onebit_adam", _onebit_warmup(0.4)),  # freeze at 40 % of the run, not 20 %
    "adamw lr=1e-3": ("adamw", ("optim.lr=1.0e-3",)),  # 1-bit Adam's LR: its gap to AdamW is then compression's
    "slamb beta3=0.93 H=20": ("slamb", ("optim.beta3=0.93", "optim.sync_interval=20")),
}
# LARS is a vision optimizer (SlowMo's base for Swin): the BERT study leaves it out unless asked for.
NOT_BY_DEFAULT = ("lars",)


def default_variants() -> list[str]:
    return [name for name in runnable_optimizers() if name not in NOT_BY_DEFAULT] + list(SETTINGS)


def build_variant(label: str, steps: int) -> Variant:
    if label in SETTINGS:
        optimizer, settings = SETTINGS[label]
        return Variant(label, optimizer, tuple(settings(steps) if callable(settings) else settings))
    return Variant(label, label)


class ConvergenceStudy:
    """The runs of one study, their commands and where their results land."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        logging = ["logger.progress_bar=false", "logger.tensorboard=false", "logger.wandb=disabled"]
        self.device = ["trainer.device=cuda" if args.gpus else "trainer.device=cpu"]
        self.common = [*logging, *self.device]
        self.variants = [build_variant(label, args.steps) for label in args.variants]

    def bert_dir(self, variant: Variant, seed: int) -> Path:
        return self.out / "bert" / variant.slug() / f"seed{seed}"

    def squad_dir(self, variant: Variant, seed: int) -> Path:
        return self.out / "squad" / variant.slug() / f"seed{seed}"

    def bert_command(self, variant: Variant, seed: int) -> list[str]:
        a, steps = self.args, self.args.steps
        eval_every = max(1, steps // 4)
        log_every = math.gcd(eval_every, max(1, steps // 50))  # a training record (with bytes) at every eval
        own_seed = [f"optim.seed={seed}"] if variant.optimizer in SEEDED else []
        return [stages.optimizer_choice(variant.optimizer), f"name=convergence_{variant.slug()}_seed{seed}",
                f"model=bert_{a.size}", *stages.corpus_overrides(a.corpus, a.corpus_path),
                f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}", f"trainer.log_every={log_every}",
                f"trainer.seed={seed}", *own_seed, "trainer.checkpoint_every=0",
                *stages.schedule_overrides(variant.optimizer, steps), *variant.overrides, *self.common,
                f"trainer.nproc_per_node={a.gpus or a.ranks}", *a.override,
                override("hydra.run.dir", self.bert_dir(variant, seed))]

    def squad_command(self, variant: Variant, seed: int) -> list[str]:
        weights = RunDir(self.bert_dir(variant, seed)).export_dir
        return stages.squad_overrides(weights, f"convergence_squad_{variant.slug()}_seed{seed}", self.args.squad_epochs,
                               self.common, self.squad_dir(variant, seed))


SEEDED = ("slamb", "slamb_v2_official", "jointspar")  # optimizers with a seed of their own (conf/optim/*.yaml)


def validation_curve(run_dir: Path) -> list[tuple[int, float, int]]:
    """(step, validation loss, bytes sent per rank by then) of every evaluation of a run."""
    records = read_metrics(run_dir)
    sent = {r["step"]: r.get("comm_bytes_total", 0) for r in records if "loss" in r}
    return [(r["step"], r[VALIDATION_LOSS], sent.get(r["step"], 0)) for r in records if VALIDATION_LOSS in r]


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean over seeds and its standard error (sample standard deviation / sqrt(n); 0 for one seed)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def comparison_rows(study: ConvergenceStudy, squad: bool) -> list[dict[str, Any]]:
    """One row per variant (see the module docstring), fewest bits per parameter first."""
    seeds = study.args.seeds
    finals: dict[str, list[float]] = {}
    rows = []
    for variant in study.variants:
        summaries = [stages.read_summary(study.bert_dir(variant, s)) for s in range(seeds)]
        curves = [validation_curve(study.bert_dir(variant, s)) for s in range(seeds)]
        finals[variant.label] = [s["validation_loss"] for s in summaries]
        row: dict[str, Any] = {"variant": variant.label,
                               "bits/param/step": statistics.fmean(s["bits_per_param_per_step"] for s in summaries)}
        for points in zip(*curves, strict=False):  # every seed's evaluation at one step
            row[f"val loss @{points[0][0]}"] = statistics.fmean(p[1] for p in points)
        row["final per seed"] = " ".join(f"{v:.3f}" for v in finals[variant.label])
        row["wall min"] = statistics.fmean(s["elapsed_seconds"] for s in summaries) / 60
        if squad:
            f1 = [stages.read_summary(study.squad_dir(variant, s))["best"]["eval/f1"] for s in range(seeds)]
            row["SQuAD F1"] = statistics.fmean(f1)
        rows.append(row)
    reference = finals.get(REFERENCE)
    for row in rows:
        row.update(difference_to_reference(finals[row["variant"]], reference))
    return sorted(rows, key=lambda row: row["bits/param/step"])


def difference_to_reference(values: list[float], reference: list[float] | None) -> dict[str, Any]:
    """The difference of mean final validation losses to LAMB's, its standard error (both means' errors
    combined) and their ratio: |ratio| < 2 is within the seeds' noise."""
    if reference is None:
        return {"vs lamb": None, "SE": None, "vs lamb / SE": None}
    (mean, error), (ref_mean, ref_error) = _mean_and_error(values), _mean_and_error(reference)
    difference, combined = mean - ref_mean, math.hypot(error, ref_error)
    return {"vs lamb": difference, "SE": combined, "vs lamb / SE": difference / combined if combined else None}


def draw_curves(study: ConvergenceStudy, path: Path, x_index: int, xlabel: str, log_x: bool) -> None:
    """Validation loss against steps (`x_index` 0) or bytes sent (2): per variant the mean over seeds, the seeds'
    range shaded."""
    from benchmarks.paper.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(9.0, 5.0))
    for index, variant in enumerate(study.variants):
        curves = [validation_curve(study.bert_dir(variant, s)) for s in range(study.args.seeds)]
        points = list(zip(*curves, strict=False))  # per evaluation, every seed's point
        xs = [statistics.fmean(max(p[x_index], 1) if log_x else p[x_index] for p in at) for at in points]
        losses = [[p[1] for p in at] for at in points]
        style = "-" if variant.label == variant.optimizer else "--"
        colour = f"C{index % 10}"
        ax.plot(xs, [statistics.fmean(v) for v in losses], style, marker=".", color=colour, label=variant.label)
        ax.fill_between(xs, [min(v) for v in losses], [max(v) for v in losses], color=colour, alpha=0.15)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("BERT validation loss (MLM + NSP)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"validation loss, mean of {study.args.seeds} seeds (range shaded)")
    save_figure(fig, path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Every run is a `python -m train` run; rerunning resumes.")
    parser.add_argument("--out", type=Path, default=Path("runs/convergence"), help="where the runs and tables go")
    parser.add_argument("--variants", nargs="+", default=None,
                        help=f"optimizers and settings (default: every runnable optimizer but "
                             f"{', '.join(NOT_BY_DEFAULT)}, then: {'; '.join(SETTINGS)})")
    parser.add_argument("--seeds", type=int, default=2, help="runs per variant, seeds 0, 1, ...")
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
    args = parser.parse_args(argv)
    args.variants = args.variants or default_variants()
    runnable = runnable_optimizers()
    unknown = [v for v in args.variants if v not in SETTINGS and v not in runnable]
    if unknown:
        raise UserError(f"--variants {' '.join(unknown)}: not runnable here; choose from "
                        f"{', '.join(runnable)} or a setting: {'; '.join(SETTINGS)}")
    if REFERENCE not in args.variants:
        raise UserError(f"--variants must include {REFERENCE}: every difference is measured against it")
    for flag in ("steps", "ranks", "seeds"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    return args


def run_study(args: argparse.Namespace) -> None:
    """Every run (a variant's seeds together, the optimizers before the settings), then the table and figures."""
    study = ConvergenceStudy(args)
    if args.corpus == "python_docs":
        stages.prepare_corpus(args.corpus_path)
    workers = f"{args.gpus} GPU(s)" if args.gpus else f"{args.ranks} CPU rank(s)"
    print(f"convergence study in {study.out}: BERT-{args.size}, {args.steps} steps, {workers}, "
          f"{len(study.variants)} variants x {args.seeds} seeds; SQuAD {args.squad_epochs} epochs", flush=True)
    start = time.perf_counter()
    for variant in study.variants:  # the optimizers first, each with all its seeds: a cut study still compares
        for seed in range(args.seeds):
            stages.train(f"bert  {variant.label} seed {seed}", study.bert_command(variant, seed),
                  study.bert_dir(variant, seed))
            if args.squad_epochs:
                stages.train(f"squad {variant.label} seed {seed}", study.squad_command(variant, seed),
                      study.squad_dir(variant, seed))
    rows = comparison_rows(study, args.squad_epochs > 0)
    title = (f"BERT-{args.size}, {args.steps} steps on {args.corpus} with {workers}, {args.seeds} seeds; validation "
             f"loss on the held-out split; vs lamb: difference of mean final validation losses, SE its standard "
             f"error")
    markdown = f"{title}\n\n{markdown_table(rows)}"
    atomic_write_text(study.out / "convergence.md", markdown)
    atomic_write_text(study.out / "convergence.csv", csv_table(rows))
    draw_curves(study, study.out / "val_loss_vs_step.png", 0, "optimizer step", log_x=False)
    draw_curves(study, study.out / "val_loss_vs_bytes.png", 2, "bytes sent per rank since step 0", log_x=True)
    print("\n" + markdown, flush=True)
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min: {study.out / 'convergence.md'}")


def main(argv: list[str] | None = None) -> None:
    with user_errors_exit(), stage_stops_exit():
        run_study(parse_args(argv))


if __name__ == "__main__":
    main()
