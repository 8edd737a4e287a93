"""The paper's comparison at a chosen scale: BERT pretraining with every optimizer at equal steps, SQuAD
fine-tuning of each result, Swin on images, then the comparison table and the report's plots.

    python -m benchmarks.paper.reproduce                        # CPU scale: tiny BERT, python_docs, 4 gloo ranks
    python -m benchmarks.paper.reproduce --optimizers lamb slamb onebit_lamb --steps 300
    python -m benchmarks.paper.reproduce --size base --steps 2000 --gpus 8 --override precision=bf16
    python -m benchmarks.paper.reproduce --simulated-network 10gbe   # collectives take a modelled network's time

Every stage is an ordinary `python -m train` run with its own run directory under `--out`, so rerunning the
command resumes an interrupted study and skips finished runs (change `--out` to start afresh). Ctrl-C (or SIGTERM)
is passed on to the running stage, which saves its stop checkpoint before the study exits 130 (143).

1. BERT pretraining (`--size`, default the 4.4M-parameter tiny BERT) on the prepared `python_docs` corpus
   (prepared on first use: it downloads Debian's python3.11-doc once; `--corpus demo` takes the embedded
   corpus instead), `--ranks` processes, the same seed, data and `--steps` for every optimizer. Where the repo
   has a BERT preset for an optimizer (`conf/experiment/<name>_bert.yaml`: SLAMB's fp16 momentum, 1-bit
   LAMB's published coefficients) it is used. Schedules measured in steps are scaled to `--steps` so that
   every stage of every algorithm happens (see `schedule_overrides`).
2. SQuAD: each pretrained model is fine-tuned with AdamW on the shipped SQuAD-format file and scored on it
   (`experiment=squad_demo`): it shows what each pretraining gives a downstream task at this scale; it is
   not SQuAD v1.1 dev.
3. Swin: the offline digits (`experiment=swin_demo`) with `--swin-optimizers`, top-1 on held-out digits.
4. `comparison.md` / `comparison.csv` join each optimizer's pretraining, fine-tuning and Swin results (one
   row per optimizer); `python -m benchmarks.paper.report` draws the plots from the BERT runs into `report/`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import REPO, csv_table, markdown_table
from benchmarks.paper.stages import (
    PYTHON_DOCS,
    corpus_overrides,
    optimizer_choice,
    prepare_corpus,
    read_summary,
    schedule_overrides,
    squad_overrides,
    train,
)
from core.atomic import atomic_write_text
from core.errors import UserError, user_errors_exit
from optim.apex import runnable_optimizers
from train.run_dir import RunDir
from train.subprocess_stage import override, run_stage, stage_stops_exit

SWIN_LR = {"lamb": 1.0e-2, "slamb": 1.0e-2, "slamb_v2_official": 1.0e-2}  # swin_demo's AdamW LR is 3e-3


class Study:
    """The runs of one reproduction, their commands and where their results land."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        logging = ["logger.progress_bar=false", "logger.tensorboard=false", "logger.wandb=disabled"]
        device = "trainer.device=cuda" if args.gpus else "trainer.device=cpu"
        network = [f"trainer.simulated_network={args.simulated_network}"] if args.simulated_network else []
        self.single = [*logging, device]  # fine-tuning: one process
        self.parallel = [*logging, device, f"trainer.nproc_per_node={args.gpus or args.ranks}", *network]

    def bert_dir(self, name: str) -> Path:
        return self.out / "bert" / name

    def squad_dir(self, name: str) -> Path:
        return self.out / "squad" / name

    def swin_dir(self, name: str) -> Path:
        return self.out / "swin" / name

    def bert_command(self, name: str) -> list[str]:
        a = self.args
        return [optimizer_choice(name), f"name=reproduce_bert_{name}", f"model=bert_{a.size}",
                *corpus_overrides(a.corpus, a.corpus_path),
                f"trainer.max_steps={a.steps}", f"trainer.log_every={max(1, a.steps // 50)}",
                "trainer.checkpoint_every=0", *schedule_overrides(name, a.steps), *self.parallel, *a.override,
                override("hydra.run.dir", self.bert_dir(name))]

    def squad_command(self, name: str) -> list[str]:
        return squad_overrides(RunDir(self.bert_dir(name)).export_dir, f"reproduce_squad_{name}",
                               self.args.squad_epochs, self.single, self.squad_dir(name))

    def swin_command(self, name: str) -> list[str]:
        lr = [f"optim.lr={SWIN_LR[name]}"] if name in SWIN_LR else []
        return ["experiment=swin_demo", f"optim={name}", *lr, f"name=reproduce_swin_{name}",
                f"trainer.epochs={self.args.swin_epochs}", "trainer.micro_batch_size=null", *self.parallel,
                override("hydra.run.dir", self.swin_dir(name))]


COLUMNS = ("optimizer", "pretraining loss", "bits/param/step", "vs lamb", "GB sent per rank", "step ms",
           "pretraining min", "SQuAD F1", "SQuAD EM", "Swin top-1")


def comparison_rows(study: Study, bert: Sequence[str], squad: bool, swin: Sequence[str]) -> list[dict[str, str]]:
    """One row per optimizer, fewest bits per parameter first (Swin-only rows last): its pretraining summary
    joined with its fine-tuning and Swin results."""
    summaries = {name: read_summary(study.bert_dir(name)) for name in bert}
    reference = summaries.get("lamb", {}).get("bits_per_param_per_step")
    rows = []
    for name in dict.fromkeys([*bert, *swin]):
        row = dict.fromkeys(COLUMNS, "")
        row["optimizer"] = name
        if name in summaries:
            s = summaries[name]
            bits = s["bits_per_param_per_step"]
            row.update({"pretraining loss": f"{s['final']['loss']:.3f}", "bits/param/step": f"{bits:.3f}",
                        "vs lamb": f"{bits / reference:.3f}" if reference else "",
                        "GB sent per rank": f"{s['bytes_total'] / 1e9:.3f}",
                        "step ms": f"{1e3 * s['mean_step_seconds']:.0f}",
                        "pretraining min": f"{s['elapsed_seconds'] / 60:.1f}"})
            if squad:
                best = read_summary(study.squad_dir(name))["best"]
                row.update({"SQuAD F1": f"{best['eval/f1']:.1f}", "SQuAD EM": f"{best['eval/exact_match']:.1f}"})
        if name in swin:
            row["Swin top-1"] = f"{read_summary(study.swin_dir(name))['best']['eval/top1']:.1f}"
        rows.append(row)
    return sorted(rows, key=lambda row: float(row["bits/param/step"] or "inf"))


def write_comparison(rows: list[dict[str, str]], out: Path, title: str) -> str:
    """comparison.md and comparison.csv under `out`, in the report's table formats; returns the Markdown."""
    markdown = f"{title}\n\n{markdown_table(rows)}"
    atomic_write_text(out / "comparison.md", markdown)
    atomic_write_text(out / "comparison.csv", csv_table(rows))
    return markdown


def draw_report(run_dirs: list[Path], out: Path) -> None:
    """`python -m benchmarks.paper.report` over `run_dirs` into `out`: a stage like the training runs, its output
    in this one's (a script runs another script, never imports it)."""
    command = [sys.executable, "-m", "benchmarks.paper.report", *map(str, run_dirs), "--out", str(out)]
    result = run_stage(command, "the report", cwd=REPO)
    if result.returncode != 0:
        print(f"the report failed (exit {result.returncode}); command: python {' '.join(command[1:])}",
              file=sys.stderr)
        raise SystemExit(2 if result.returncode == 2 else 1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Every stage is a `python -m train` run; rerunning resumes.")
    parser.add_argument("--out", type=Path, default=Path("runs/reproduce"), help="where the runs and tables go")
    parser.add_argument("--optimizers", nargs="+", default=None, help="BERT study (default: every one runnable)")
    parser.add_argument("--swin-optimizers", nargs="*", default=["lamb", "slamb", "adamw"], help="Swin study")
    parser.add_argument("--size", choices=["tiny", "base", "large", "xl"], default="tiny", help="BERT size")
    parser.add_argument("--steps", type=int, default=60, help="BERT pretraining steps, the same for every optimizer")
    parser.add_argument("--corpus", choices=["python_docs", "demo"], default="python_docs")
    parser.add_argument("--corpus-path", type=Path, default=PYTHON_DOCS, help="the prepared python_docs corpus")
    parser.add_argument("--ranks", type=int, default=4, help="CPU processes (gloo) per run")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs per run (NCCL); replaces --ranks")
    parser.add_argument("--squad-epochs", type=int, default=10, help="0: no SQuAD fine-tuning")
    parser.add_argument("--swin-epochs", type=int, default=15, help="Swin epochs on the digits (22 steps each)")
    parser.add_argument("--simulated-network", default=None, help="trainer.simulated_network for every run")
    parser.add_argument("--override", action="append", default=[], help="extra override of the BERT runs "
                        "(repeatable), e.g. --override precision=bf16")
    args = parser.parse_args(argv)
    runnable = runnable_optimizers()
    args.optimizers = args.optimizers or runnable
    for flag, names in (("--optimizers", args.optimizers), ("--swin-optimizers", args.swin_optimizers)):
        unknown = [n for n in names if n not in runnable]
        if unknown:
            raise UserError(f"{flag} {' '.join(unknown)}: not runnable here; choose from {', '.join(runnable)}")
    for flag in ("steps", "ranks"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    with user_errors_exit(), stage_stops_exit():
        run_study(parse_args(argv))


def run_study(args: argparse.Namespace) -> None:
    """Every run of the study in turn (each resumed or skipped when done), then its table and plots."""
    plan = Study(args)
    if args.corpus == "python_docs" and args.optimizers:
        prepare_corpus(args.corpus_path)
    workers = f"{args.gpus} GPU(s)" if args.gpus else f"{args.ranks} CPU rank(s)"
    print(f"study in {plan.out}: BERT-{args.size}, {args.steps} steps, {args.corpus}, {workers}; "
          f"{len(args.optimizers)} optimizers; SQuAD {args.squad_epochs} epochs; Swin: "
          f"{', '.join(args.swin_optimizers) or 'none'}", flush=True)
    start = time.perf_counter()
    for name in args.optimizers:
        train(f"bert  {name}", plan.bert_command(name), plan.bert_dir(name))
    if args.squad_epochs:
        for name in args.optimizers:
            train(f"squad {name}", plan.squad_command(name), plan.squad_dir(name))
    for name in args.swin_optimizers:
        train(f"swin  {name}", plan.swin_command(name), plan.swin_dir(name))
    rows = comparison_rows(plan, args.optimizers, args.squad_epochs > 0, args.swin_optimizers)
    simulated = f", simulated network {args.simulated_network}" if args.simulated_network else ""
    title = (f"BERT-{args.size}, {args.steps} steps on {args.corpus} with {workers}{simulated}; SQuAD: fine-tuned "
             f"{args.squad_epochs} epochs on the shipped file; Swin: digits, {args.swin_epochs} epochs")
    print("\n" + write_comparison(rows, plan.out, title), flush=True)
    if args.optimizers:
        draw_report([plan.bert_dir(name) for name in args.optimizers], plan.out / "report")
    print(f"done in {(time.perf_counter() - start) / 60:.1f} min: {plan.out / 'comparison.md'}, "
          f"{plan.out / 'report'}")


if __name__ == "__main__":
    main()
