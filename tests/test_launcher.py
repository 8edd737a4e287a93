"""The local launcher: a user error in a worker ends the run as in one process (one line), a crash does not."""

from __future__ import annotations

import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from conf.checks import ConfigError, ReportedError
from train.distributed import launch_local_workers


def _worker(failing_ranks: list[int], error: str) -> None:
    """A worker that fails on `failing_ranks` with a user error (`error="user"`) or a crash."""
    rank = int(os.environ["RANK"])
    if rank in failing_ranks:
        if error == "user":
            raise ConfigError("data.path=/nowhere does not exist")
        raise ZeroDivisionError("a bug")


def test_a_user_error_in_workers_is_reported_once_in_one_line():
    with pytest.raises(ReportedError) as info:  # rank 0 is fine; ranks 1 and 2 meet the same error
        launch_local_workers(_worker, 3, [1, 2], "user")
    assert str(info.value) == "config error: data.path=/nowhere does not exist"


def test_a_crash_in_a_worker_keeps_the_launchers_report():
    with pytest.raises(ChildFailedError, match="ZeroDivisionError"):
        launch_local_workers(_worker, 2, [1], "crash")
