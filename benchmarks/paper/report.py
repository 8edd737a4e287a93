"""`python -m benchmarks.paper.report RUN_DIR...`: the paper-style comparison of training runs, as a table and plots.

    python -m benchmarks.paper.report runs/lamb runs/slamb              # run directories
    python -m benchmarks.paper.report runs/demo-multirun --out report   # every run under a folder (a Hydra multirun)
    python -m benchmarks.paper.report 'runs/*' --target-loss 7.5        # globs, quoted or expanded by the shell

A run is a directory holding `metrics.jsonl`. Its `summary.json` (the trainer's, written at the end of every run)
fills the row; a run without one (killed, or trained before summaries existed) is reported from `metrics.jsonl`
and `.hydra/config.yaml`, with what those cannot tell left blank. Writes `table.md`, `table.csv` and the plots of
`benchmarks.paper.plots` to `--out`, and prints the Markdown table.

Runs are compared on their validation loss (`eval/loss`, the paper's "BERT validation loss") when every run has one,
else on their training loss. Time to target is the `elapsed` training time of a run's first record whose loss is at
most the target loss; the default target is the highest final loss among the runs, so that every run reaches it.
Eval columns hold the final value of every eval score any run logged (`train.summary.higher_is_better` says which
keys are scores).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.common import csv_table, markdown_table
from core.atomic import atomic_write_text
from core.errors import UserError, user_errors_exit
from train.metrics import read_metrics
from train.run_dir import RunDir
from train.summary import VALIDATION_LOSS, best_values, config_fields, final_values, higher_is_better


@dataclass
class Run:
    name: str  # its path relative to the folder all reported runs share
    path: Path
    summary: dict[str, Any]  # summary.json, or what metrics.jsonl and the recorded config tell of it
    records: list[dict[str, Any]]  # metrics.jsonl

    @property
    def train_records(self) -> list[dict[str, Any]]:
        """The training records (eval records carry eval/* keys only)."""
        return [r for r in self.records if "loss" in r]


def find_runs(paths: list[str]) -> list[Path]:
    """The run directories named by `paths`: run directories, globs, or folders searched for runs."""
    found: list[Path] = []
    for arg in paths:
        matches = sorted(glob.glob(arg)) if glob.has_magic(arg) else [arg]
        if not matches:
            raise UserError(f"{arg} matches nothing")
        for match in map(Path, matches):
            if not match.exists():
                raise UserError(f"{match} does not exist")
            metrics_name = RunDir(match).metrics_file.name
            runs = [match] if RunDir(match).metrics_file.is_file() else sorted(
                p.parent for p in match.rglob(metrics_name))
            found += [run for run in runs if run not in found]
    if not found:
        raise UserError(f"no runs (directories with {RunDir(Path()).metrics_file.name}) in {' '.join(paths)}")
    return found


def load_runs(paths: list[Path]) -> list[Run]:
    """The runs of one task (a `UserError` names the tasks otherwise: their losses share no axis or target)."""
    runs = [Run(name=name, path=p, summary=_summary(p), records=read_metrics(p))
            for name, p in zip(run_names(paths), paths, strict=True)]
    tasks: dict[str, list[str]] = {}
    for run in runs:
        tasks.setdefault(str(run.summary.get("task")), []).append(run.name)
    if len(tasks) > 1:
        listed = "; ".join(f"{task}: {', '.join(names)}" for task, names in tasks.items())
        raise UserError(f"runs of {len(tasks)} tasks ({listed}): report each task's runs separately")
    return runs


def run_names(paths: list[Path]) -> list[str]:
    """Each run's path relative to the folder the runs share; a multirun job (a numbered directory) is named by the
    overrides that set it apart from the other jobs, not by its number."""
    common = Path(os.path.commonpath([p.resolve() for p in paths]))
    overrides = {p: RunDir(p).recorded_overrides() for p in paths if p.name.isdigit()}
    shared = set.intersection(*map(set, overrides.values())) if len(overrides) > 1 else set()
    names = []
    for p in paths:
        relative = Path(p.resolve().name) if len(paths) == 1 else p.resolve().relative_to(common)
        own = " ".join(o for o in overrides.get(p, []) if o not in shared) or RunDir(p).display_name()
        names.append(str(relative.with_name(own)))
    return names


def _summary(run_dir: Path) -> dict[str, Any]:
    summary_file = RunDir(run_dir).summary_file
    if not summary_file.is_file():
        return summary_from_records(run_dir)
    try:
        return json.loads(summary_file.read_text())
    except ValueError as err:
        raise UserError(f"{summary_file} is not valid JSON ({err}): delete it to report the run from its "
                        f"{RunDir(run_dir).metrics_file.name}") from None


def summary_from_records(run_dir: Path) -> dict[str, Any]:
    """The summary fields a run's records and recorded config tell, for a run that wrote no summary.json."""
    recorded = RunDir(run_dir).recorded_config()
    summary = config_fields(recorded) if recorded is not None else {}
    records = read_metrics(run_dir)
    train = [r for r in records if "loss" in r]
    if not train:
        return summary
    steps = train[-1]["step"]
    # Each record's per-step bits stand for the steps since the previous record (exact without fp16 skips).
    bits = sum((r["step"] - p["step"]) * r["comm_bits_per_param"] for p, r in pairwise([{"step": 0}, *train]))
    return {**summary, "steps": steps, "final": final_values(records), "best": best_values(records),
            "bits_per_param_per_step": bits / steps, "bytes_total": train[-1].get("comm_bytes_total"),
            "elapsed_seconds": records[-1].get("elapsed")}


def compared_loss(runs: list[Run]) -> str:
    """The loss the runs are compared on: the validation loss (`eval/loss`, the paper's "BERT validation loss")
    when every run has one, else the training loss."""
    every = all(VALIDATION_LOSS in run.summary.get("final", {}) for run in runs)
    return VALIDATION_LOSS if every else "loss"


def default_target_loss(runs: list[Run], key: str) -> float | None:
    """The highest final `key` loss among the runs: a loss every run reached."""
    finals = [run.summary["final"][key] for run in runs if key in run.summary.get("final", {})]
    return max(finals, default=None)


def time_to_loss(run: Run, target: float, key: str = "loss") -> float | None:
    """The training time of the run's first record whose `key` loss is at or below `target` (None: never, or no
    times recorded)."""
    return next((r.get("elapsed") for r in run.records if key in r and r[key] <= target), None)


def table_rows(runs: list[Run], target: float | None, key: str = "loss") -> list[dict[str, Any]]:
    """One row per run; None where the run cannot tell. The target and the time to it are of the `key` loss."""
    eval_keys = sorted({key for run in runs for key in run.summary.get("final", {})
                        if key.startswith("eval/") and higher_is_better(key) is not None})
    rows = []
    for run in runs:
        s, final = run.summary, run.summary.get("final", {})
        rows.append({
            "run": run.name,
            "optimizer": s.get("optimizer"),
            "world_size": s.get("world_size"),
            "steps": s.get("steps"),
            "final_loss": final.get("loss"),
            **{key: final.get(key) for key in eval_keys},
            "bits_per_param_per_step": s.get("bits_per_param_per_step"),
            "bytes_total": s.get("bytes_total"),
            "mean_step_seconds": s.get("mean_step_seconds"),
            "samples_per_second": s.get("samples_per_second"),
            "samples_unit": s.get("samples_unit"),
            "target": f"{key} {target:.4g}" if target is not None else None,
            "time_to_target_s": time_to_loss(run, target, key) if target is not None else None,
            "simulated": "simulated" if s.get("simulated_network") else "",
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.paper.report", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", metavar="RUN_DIR", help="run directories, globs or folders of runs")
    parser.add_argument("--out", type=Path, default=Path("report"), help="output folder (default: report/)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="loss for the time-to-target column (validation loss where every run has one; "
                        "default: the highest final loss among the runs)")
    args = parser.parse_args(argv)
    with user_errors_exit():
        if args.out.exists() and not args.out.is_dir():
            raise UserError(f"--out {args.out} is a file: name a folder for the table and plots")
        runs = load_runs(find_runs(args.paths))
        write_report(runs, args.out, args.target_loss)


def write_report(runs: list[Run], out: Path, target_loss: float | None) -> None:
    """The table and plots of `runs` into `out`, and the table on stdout."""
    from benchmarks.paper.plots import write_plots  # matplotlib only once there is something to draw

    key = compared_loss(runs)
    target = target_loss if target_loss is not None else default_target_loss(runs, key)
    rows = table_rows(runs, target, key)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows)
    atomic_write_text(out / "table.md", table)
    atomic_write_text(out / "table.csv", csv_table(rows))
    plots = write_plots(runs, out)
    print(table)
    print(f"{len(runs)} run(s); wrote table.md, table.csv, {', '.join(p.name for p in plots)} to {out}")


if __name__ == "__main__":
    main()
