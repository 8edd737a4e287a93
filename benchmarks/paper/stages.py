"""What the paper's studies (`benchmarks.paper.reproduce`, `benchmarks.paper.convergence`) share: each run is an
ordinary `python -m train` stage, resumed or skipped when done, and the presets, step-scaled schedules, corpus and
fine-tuning that make the optimizers comparable at equal steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import REPO
from core.errors import UserError
from train.run_dir import RunDir
from train.subprocess_stage import StageStopped, override, run_stage

PYTHON_DOCS = REPO / "data" / "prepared" / "python_docs"


def schedule_overrides(name: str, steps: int) -> list[str]:
    """Settings counted in steps, scaled so that every stage of optimizer `name` happens within `steps`.

    1-bit Adam / LAMB: the full-precision warm-up ends at 20 % of the run (the tutorials' 15-25 %); 0/1 Adam:
    the variance freezes there, its refresh interval doubles after the first half of that (so 1-bit gradient
    steps come between refreshes, and v, never bias-corrected, has had enough refreshes not to blow the steps
    up; with 1/8 it diverged) and the local-step interval every 10 % of the run; SlowMo: a weight average every
    tenth of the run, and at the last step so that all replicas end equal.
    """
    fifth = max(2, steps // 5)
    if name in ("onebit_adam", "onebit_lamb"):
        return [f"optim.freeze_step={fifth}"]
    if name == "zero_one_adam":
        return [f"optim.var_freeze_step={fifth}", f"optim.var_update_scaler={max(1, fifth // 2)}",
                f"optim.local_step_scaler={max(1, steps // 10)}"]
    if name == "slowmo":
        return [f"optim.sync_interval={_largest_divisor_up_to(steps, max(1, steps // 10))}"]
    return []


def _largest_divisor_up_to(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


def corpus_overrides(corpus: str, path: Path) -> list[str]:
    """The data of a study's BERT runs: the prepared python_docs corpus at `path`, or the embedded demo corpus."""
    return ["data=demo"] if corpus == "demo" else ["data=python_docs", override("data.path", path)]


def optimizer_choice(name: str) -> str:
    """`experiment=<name>_bert` where the repo has a BERT preset for the optimizer, else `optim=<name>`."""
    return f"experiment={name}_bert" if (REPO / "conf" / "experiment" / f"{name}_bert.yaml").exists() else \
        f"optim={name}"


def squad_overrides(weights: Path, name: str, epochs: int, common: list[str], run_dir: Path) -> list[str]:
    """The fine-tuning of pretrained `weights` (an export) on the shipped SQuAD-format file, one process."""
    return ["experiment=squad_demo", f"name={name}", override("model.config_from", weights),
            override("trainer.init_from", weights), "data.vocab_path=null", f"trainer.epochs={epochs}", *common,
            override("hydra.run.dir", run_dir)]


def finished_as_asked(run_dir: Path, overrides: list[str]) -> bool:
    """Whether `run_dir` holds a finished run of exactly these overrides (its recorded ones), so that a rerun of
    the study skips it without starting workers; anything else goes to `python -m train`, which resumes it."""
    summary, recorded = RunDir(run_dir).summary_file, RunDir(run_dir).overrides_file
    if not (summary.is_file() and recorded.is_file()):
        return False
    asked = [o for o in overrides if not o.startswith("hydra.")]
    try:
        finished = json.loads(summary.read_text()).get("finished") is True
    except ValueError:  # cut mid-write: the run, resumed, writes it again
        return False
    return finished and yaml.safe_load(recorded.read_text()) == asked


def train(label: str, overrides: list[str], run_dir: Path) -> None:
    """One `python -m train` run (resumed, or skipped when finished); its log goes to <run dir>/reproduce.log."""
    if finished_as_asked(run_dir, overrides):
        print(f"{label:<34} ... done before", flush=True)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    print(f"{label:<34} ...", end="", flush=True)
    with open(run_dir / "reproduce.log", "w") as log:
        try:
            result = run_stage([sys.executable, "-m", "train", *overrides], f"{' '.join(label.split())} "
                               f"({run_dir})", cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        except StageStopped:
            print(" stopped", flush=True)
            raise
    if result.returncode != 0:
        print(" failed")
        tail = (run_dir / "reproduce.log").read_text().strip().splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        command = " ".join(["python -m train", *overrides])
        print(f"the run above failed (exit {result.returncode}); its log: {run_dir / 'reproduce.log'}; "
              f"command: {command}", file=sys.stderr)
        raise SystemExit(2 if result.returncode == 2 else 1)
    print(f" {time.perf_counter() - start:6.0f} s", flush=True)


def prepare_corpus(path: Path) -> None:
    """Prepare the python_docs corpus, with its held-out split, at `path` unless it is there (a one-time download
    of ~11 MB)."""
    manifest = path / "phase1" / "manifest.json"
    if manifest.is_file() and "heldout" in json.loads(manifest.read_text()):
        return
    if manifest.is_file():  # prepared before held-out splits: the study needs one for its validation loss
        raise UserError(f"{path} has no held-out split (prepared by an older version): delete it and rerun to "
                        "prepare it again")
    print(f"preparing the python_docs corpus into {path} (once) ...", flush=True)
    result = run_stage([sys.executable, "-m", "data.prepare", "corpus=python_docs", override("output_dir", path)],
                       f"the preparation of {path}", cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
    if result.returncode != 0:
        print(result.stderr.strip()[-2000:], file=sys.stderr)
        raise UserError(f"could not prepare the python_docs corpus into {path} (it downloads Debian's "
                         "python3.11-doc once); rerun with --corpus demo to use the embedded corpus")


def read_summary(run_dir: Path) -> dict[str, Any]:
    path = RunDir(run_dir).summary_file
    if not path.exists():
        raise UserError(f"{path} is missing: the run did not finish; rerun the same command to resume it")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({err}): delete it and rerun the same command") from None
