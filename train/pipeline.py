"""`python -m train.pipeline`: BERT phase 1, phase 2 and SQuAD fine-tuning in sequence, then F1 / EM.

Each stage is an ordinary `python -m train` run in its own run directory, started from the previous
stage: phase 2 from phase 1's run directory (its final checkpoint's weights; `--phase2
trainer.init_optimizer_state=true` continues LAMB's moments too, as NVIDIA's recipe does), SQuAD from phase 2's
exported weights. Rerunning the command resumes the stage that was interrupted; finished stages
report that they are complete and are skipped. Ctrl-C (or SIGTERM) is passed on to the running stage, which saves
its stop checkpoint; the pipeline then exits 130 (143) with a line naming the stage. A stage that refuses its
configuration (exit 2) stops the pipeline with exit 2: fix the value its error names, then rerun.

    python -m train.pipeline --phase1 data.path=/data/wiki_books --phase2 data.path=/data/wiki_books
    python -m train.pipeline --all trainer.nproc_per_node=8 --phase1 data.path=... --phase2 data.path=... \
        --squad data.train_file=... data.dev_file=...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.errors import UserError, user_errors_exit
from train.metrics import read_metrics
from train.run_dir import RunDir
from train.subprocess_stage import override, run_stage, stage_stops_exit

STAGES = ("phase1", "phase2", "squad")
EXPERIMENTS = {"phase1": "bert_large_phase1", "phase2": "bert_large_phase2", "squad": "bert_large_squad"}

# Published SQuAD v1.1 dev results for BERT-Large fine-tuned with the recipe above: (source, EM, F1).
REFERENCES = (
    ("NVIDIA, Wikipedia + BooksCorpus (5-seed mean)", 84.30, 91.08),
    ("NVIDIA, Wikipedia only (10-seed mean)", 83.96, 90.68),
    ("DeepSpeed bing_bert, NVIDIA data", 83.57, 90.62),
    ("BERT paper (Devlin et al.)", 84.1, 90.9),
)


def stage_command(stage: str, prefix: str, runs_dir: Path, overrides: list[str]) -> list[str]:
    """The `python -m train` command of one stage; each stage starts from the previous one: phase 2 from its run
    directory (its weights), SQuAD (another model head, another optimizer) from its export."""
    run_dir = runs_dir / f"{prefix}_{stage}"
    args = [f"experiment={EXPERIMENTS[stage]}", override("name", f"{prefix}_{stage}"),
            override("hydra.run.dir", run_dir)]
    previous = STAGES[STAGES.index(stage) - 1] if stage != STAGES[0] else None
    if previous is not None:
        source = runs_dir / f"{prefix}_{previous}"
        args.append(override("trainer.init_from", source if stage == "phase2" else RunDir(source).export_dir))
    return [sys.executable, "-m", "train", *args, *overrides]


def squad_result(run_dir: Path) -> tuple[float, float]:
    """(EM, F1) of the last evaluation logged in a SQuAD run directory."""
    evaluations = [r for r in read_metrics(run_dir) if "eval/f1" in r]
    if not evaluations:
        raise UserError(f"{run_dir} has no SQuAD evaluation in its {RunDir(run_dir).metrics_file.name}")
    return evaluations[-1]["eval/exact_match"], evaluations[-1]["eval/f1"]


def results_table(em: float, f1: float) -> str:
    rows = [("this run", em, f1), *REFERENCES]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'SQuAD v1.1 dev':<{width}}  {'EM':>6}  {'F1':>6}"]
    lines += [f"{name:<{width}}  {e:6.2f}  {f:6.2f}" for name, e, f in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default="bert_large", help="run names are <prefix>_phase1, ...")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"), help="where the run directories go")
    parser.add_argument("--all", nargs="*", default=[], metavar="OVERRIDE", help="overrides for every stage")
    for stage in STAGES:
        parser.add_argument(f"--{stage}", nargs="*", default=[], metavar="OVERRIDE", help=f"overrides for {stage}")
    args = parser.parse_args(argv)
    with user_errors_exit(), stage_stops_exit():
        for stage in STAGES:
            command = stage_command(stage, args.prefix, args.runs_dir, [*args.all, *getattr(args, stage)])
            print(f"== {stage}: {' '.join(command[1:])}", flush=True)
            returncode = run_stage(command, f"stage {stage}").returncode
            if returncode == 2:  # the stage printed what to fix; nothing of it ran
                raise UserError(f"pipeline stopped: stage {stage} refused its settings (the line above names the "
                                f"value); fix it in --{stage} or --all and rerun: finished stages are skipped")
            if returncode != 0:
                print(f"pipeline stopped: stage {stage} failed (exit {returncode}); rerun the same command to "
                      "resume it", file=sys.stderr)
                return 1
        em, f1 = squad_result(args.runs_dir / f"{args.prefix}_squad")
    print(results_table(em, f1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
