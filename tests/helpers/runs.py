"""Project commands in subprocesses, from the repository root: a training run to its end or in the background, and
any `python -m` module."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from helpers.config import REPO


def _train_env() -> dict[str, str]:
    """Unbuffered, so a test reads the output as it comes; one intra-op thread, as the tiny tensors need."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def run_train(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m train <args>` in a subprocess, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=REPO, env=_train_env(), capture_output=True, text=True,
        timeout=timeout, **kwargs,
    )


def popen_train(args: list[str], new_session: bool = False) -> subprocess.Popen:
    """`python -m train <args>` started in the background; in a session of its own with `new_session`, so that a
    signal sent to its process group reaches the local workers too."""
    return subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, env=_train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=new_session)


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Return once the run in `run_dir` has logged `step`; fail if `proc` exits first or the time runs out."""
    from train.metrics import read_metrics  # here: modules whose spawned ranks import them need no trainer

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early:\n{proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def run_module(module: str, *args: object) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` to its end, output captured."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
