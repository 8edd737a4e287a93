"""A multirun sweep (`python -m train -m optim=lamb,adamw`) that runs every job whatever one of them does, and ends
with a table of the jobs: which ran, which failed and why.

Hydra's basic launcher stops the sweep at a job's `sys.exit` and ends it with the first failed job's traceback;
here each job's error is caught in the job (`run_job`) and reported in the table (`SweepReport`, the Hydra callback
conf/config.yaml installs), and the command's exit code says whether any job failed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from core.errors import user_error_text


@dataclass(frozen=True)
class JobOutcome:
    """How one job of a sweep ended: the exit code a single run would have ended with, and why it failed."""

    exit_code: int = 0  # 2: a user error (a value, a file); 1: anything else
    reason: str = ""  # the one line of a failure

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def run_job(job: Callable[[], None]) -> JobOutcome:
    """Run one job of a sweep; an error ends the job, not the sweep. A user error is its line, as a single run
    prints it; anything else (a bug) also prints its traceback, and the table gives its first line."""
    try:
        job()
    except Exception as err:
        line = user_error_text(err)
        if line is None:
            traceback.print_exc()
            return JobOutcome(1, _first_line(err))
        print(line, file=sys.stderr)
        return JobOutcome(getattr(err, "exit_code", 2), line)  # the code a single run exits with (core.errors)
    return JobOutcome()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class SweepReport(Callback):
    """Collects each job's outcome as it ends and, when the sweep is over, prints the table and exits non-zero if a
    job failed (2 if every failure was a user error, else 1)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[int, list[str], JobOutcome]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # A job that raised past `run_job` (a bug in the task function itself) ends the sweep with Hydra's traceback.
        if config.hydra.mode == RunMode.MULTIRUN and job_return.status == JobStatus.COMPLETED:
            self.jobs.append((config.hydra.job.num, list(job_return.overrides or []), job_return.return_value))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(sweep_table(self.jobs, config.hydra.sweep.dir), flush=True)
        failed = [outcome.exit_code for _, _, outcome in self.jobs if not outcome.ok]
        if failed:
            sys.exit(2 if set(failed) == {2} else 1)


def sweep_table(jobs: Sequence[tuple[int, list[str], JobOutcome]], sweep_dir: str) -> str:
    """The jobs, one line each: number (its directory under `sweep_dir`), the overrides that tell it from the
    others (those every job shares are left out), and ok or why it failed."""
    common = set.intersection(*(set(overrides) for _, overrides, _ in jobs)) if len(jobs) > 1 else set()
    rows = [(str(number), " ".join(o for o in overrides if o not in common) or "-",
             "ok" if outcome.ok else f"failed: {outcome.reason}") for number, overrides, outcome in jobs]
    failed = sum(not outcome.ok for _, _, outcome in jobs)
    title = f"sweep {sweep_dir}: {len(jobs) - failed} of {len(jobs)} job(s) ok"
    if failed:
        title += f", {failed} failed"
    widths = [max(len(row[i]) for row in [("job", "overrides", ""), *rows]) for i in (0, 1)]
    lines = [f"  {number:<{widths[0]}}  {overrides:<{widths[1]}}  {result}"
             for number, overrides, result in [("job", "overrides", "result"), *rows]]
    return "\n".join([title, *lines])
