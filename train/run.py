"""`run(cfg)`: lock the run directory, plan the run (where everything a user can get wrong is checked), record the
accepted config, and start workers that build from the plan and train."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from omegaconf import DictConfig

from core.errors import UserError
from train.distributed import (
    WorkerDied,
    adopt_slurm_environment,
    init_distributed,
    launch_local_workers,
    launch_rank,
    launched_externally,
    pick_device,
    shutdown_distributed,
)
from train.plan import RunPlan, plan_run
from train.run_dir import RunDir, is_new_run_directory, remove_if_empty
from train.run_lock import run_directory_lock
from train.stop import writing
from train.summary import record_stop

_SIGNALLED_WORKER_GRACE_S = 5.0  # how long a stopped worker waits for its elastic agent before leaving


def run(cfg: DictConfig, run_dir: str | Path, overrides: list[str] | None = None,
        choices: Mapping[str, str | None] | None = None) -> None:
    """Train as configured in `run_dir`, with `overrides` (the command line) and `choices` (the config group
    choices) recorded beside the checkpoints.

    Rank 0 (the launching process) holds the directory's lock for the run's life (`train.run_lock`): a second run
    there is refused. Every user error is raised by planning (`plan_run`), before anything is recorded or any worker
    starts: `ConfigError` for values that cannot work, a missing data file, or a run directory whose checkpoints this
    run cannot continue (`RunDirectoryError`). Only an accepted run rewrites the directory's recorded config, so it
    always describes its checkpoints, and a refused run leaves no directory it made behind.
    The workers get the plan (`RunPlan`), not the config: they build from it without checking anything again.
    """
    run_dir = Path(run_dir)
    new = is_new_run_directory(run_dir)
    try:
        with _rank_zero_lock(run_dir) as notices:
            plan = plan_run(cfg, run_dir, tuple(notices))  # every check, the data's files and run_dir's included
            if launch_rank() == 0:
                with writing(RunDir(run_dir).config_file):
                    RunDir(run_dir).record_config(cfg, overrides, choices)
            start_workers(plan)
    except BaseException:
        if new:
            remove_if_empty(run_dir)
        raise


@contextlib.contextmanager
def _rank_zero_lock(run_dir: Path) -> Iterator[list[str]]:
    """The run directory's lock, taken by rank 0 alone (the other ranks of a launch run under rank 0's)."""
    if launch_rank() != 0:
        yield []
        return
    with run_directory_lock(run_dir) as notices:
        yield notices


def start_workers(plan: RunPlan) -> None:
    """Train in this process, or in `trainer.nproc_per_node` local workers; a worker that dies is recorded as the
    run's stop (its rank 0 may not know why the others stopped, or may be the one that died)."""
    nproc = plan.trainer.nproc_per_node
    if nproc == 1 or launched_externally():
        train_worker(plan)
        return
    try:
        launch_local_workers(train_worker, nproc, plan)
    except WorkerDied as died:
        with contextlib.suppress(OSError, UserError):  # a full disk, say: the line itself is still reported
            record_stop(RunDir(plan.run_dir), str(died))
        raise


def train_worker(plan: RunPlan) -> None:
    """One rank's life: join the group, agree on the run directory, train, clean up."""
    from train.trainer import Trainer

    settings = plan.trainer
    adopt_slurm_environment()
    comm = init_distributed(settings.backend, pick_device(settings.device),
                            simulated_network=settings.simulated_network)
    try:
        # Rank 0's directory wins, so ranks that resolved their own (a ${now:} in it, say) still agree.
        shared_dir = Path(str(comm.broadcast_object(str(plan.run_dir))))
        trainer = Trainer(dataclasses.replace(plan, run_dir=shared_dir), comm)
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        shutdown_distributed()
    if trainer.stop_signal is not None and "TORCHELASTIC_RUN_ID" in os.environ:
        # After returning, an elastic worker waits for its agent to collect the result. An agent that was signalled
        # too is shutting down and never does: it kills the worker 30 s later. The work is saved, so a worker still
        # waiting after a few seconds leaves by itself, successfully; a running agent releases it well before.
        sys.stdout.flush()
        sys.stderr.flush()
        leave = threading.Timer(_SIGNALLED_WORKER_GRACE_S, os._exit, args=(0,))
        leave.daemon = True
        leave.start()
