"""A multirun sweep runs every job whatever one of them does, and ends with a table of the jobs."""

from __future__ import annotations

import pytest
from helpers.config import TINY
from helpers.runs import run_train

from core.errors import ConfigError
from train.sweep import JobOutcome, run_job, sweep_table


def test_a_user_error_ends_its_job_with_its_line(capsys):
    def refused() -> None:
        raise ConfigError("optim.lr=-1 must be >= 0")

    assert run_job(refused) == JobOutcome(2, "config error: optim.lr=-1 must be >= 0")
    assert capsys.readouterr().err == "config error: optim.lr=-1 must be >= 0\n"


def test_a_crash_ends_its_job_with_its_traceback_and_first_line(capsys):
    def crashes() -> None:
        raise RuntimeError("CUDA error: an illegal memory access\nmore detail")

    outcome = run_job(crashes)
    assert outcome == JobOutcome(1, "RuntimeError: CUDA error: an illegal memory access") and not outcome.ok
    assert "Traceback" in capsys.readouterr().err
    assert run_job(lambda: None).ok


def test_the_table_names_each_job_by_what_sets_it_apart():
    jobs = [(0, ["optim=lamb", "trainer.max_steps=2"], JobOutcome()),
            (1, ["optim=adamw", "trainer.max_steps=2"], JobOutcome(2, "config error: optim.lr=-1 must be >= 0"))]
    assert sweep_table(jobs, "runs/demo-multirun").splitlines() == [
        "sweep runs/demo-multirun: 1 of 2 job(s) ok, 1 failed",
        "  job  overrides    result",
        "  0    optim=lamb   ok",
        "  1    optim=adamw  failed: config error: optim.lr=-1 must be >= 0",
    ]


@pytest.mark.slow
def test_every_job_runs_after_a_failed_one_and_the_sweep_ends_with_their_table(tmp_path):
    result = run_train(["-m", *TINY, "trainer.max_steps=1", "optim.lr=-1,0.001", f"hydra.sweep.dir={tmp_path}"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == "config error: optim.lr=-1 must be >= 0"
    assert (tmp_path / "1" / "summary.json").is_file()  # the job after the failed one ran
    assert result.stdout.splitlines()[-4:] == [
        f"sweep {tmp_path}: 1 of 2 job(s) ok, 1 failed",
        "  job  overrides       result",
        "  0    optim.lr=-1     failed: config error: optim.lr=-1 must be >= 0",
        "  1    optim.lr=0.001  ok",
    ]
