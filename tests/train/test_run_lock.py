"""The run directory's lock: a second run in a directory is refused in one line naming the holder; a lock whose holder
ended is taken over with a line; the lock file goes with the run, however it ends."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.config import REPO, TINY
from helpers.runs import popen_train, run_train

import train.run_lock
from train.metrics import read_metrics
from train.run_lock import Holder, RunDirectoryInUse, run_directory_lock

_HOLD = """
import sys, time
from train.run_lock import run_directory_lock
with run_directory_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _dead_pid() -> int:
    """The pid of a process of this host that has ended."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(ended.stdout)


def _record(run_dir: Path, pid: int, host: str | None = None, slurm_job: str | None = None) -> None:
    holder = Holder(host or socket.gethostname(), pid, "2026-01-02 03:04:05", slurm_job)
    (run_dir / "run.lock").write_text(json.dumps(holder.__dict__))


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirectoryInUse) as info, run_directory_lock(tmp_path):
            pass
        assert str(info.value).startswith(f"{tmp_path} is in use by another run, pid {holder.pid} on "
                                          f"{socket.gethostname()} (started ")
        assert str(info.value).endswith("): wait for it to end or stop it, or pick another name=... for this run")
    finally:
        holder.kill()
        holder.wait()
    with run_directory_lock(tmp_path) as notices:  # killed, it holds nothing any more: its record is taken over
        [notice] = notices
        assert notice.startswith(f"taking over {tmp_path} from pid {holder.pid} on {socket.gethostname()} (started ")
        assert notice.endswith("), which ended without releasing it")
    assert not (tmp_path / "run.lock").exists()


def test_the_lock_file_goes_when_the_run_ends_in_an_error(tmp_path):
    with pytest.raises(ZeroDivisionError), run_directory_lock(tmp_path) as notices:
        assert notices == [] and json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        raise ZeroDivisionError
    assert not (tmp_path / "run.lock").exists()


@pytest.fixture
def no_locks(monkeypatch):
    """A file system without locks (some Lustre and NFS mounts)."""
    def lockf(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(train.run_lock.fcntl, "lockf", lockf)


def test_without_locks_a_live_holder_refuses_and_an_ended_one_is_taken_over(tmp_path, no_locks):
    _record(tmp_path, os.getppid())  # alive on this host
    refused = r"; this file system has no locks: if that run has ended, remove "
    with pytest.raises(RunDirectoryInUse, match=refused), run_directory_lock(tmp_path):
        pass
    _record(tmp_path, 1, host="another-host")  # may be alive: nothing here can tell
    with pytest.raises(RunDirectoryInUse, match=r"in use by another run, pid 1 on another-host \(started "), \
            run_directory_lock(tmp_path):
        pass
    dead = _dead_pid()
    _record(tmp_path, dead)
    with run_directory_lock(tmp_path) as notices:
        assert notices == [f"taking over {tmp_path} from pid {dead} on {socket.gethostname()} (started 2026-01-02 "
                           "03:04:05), which ended without releasing it"]
    assert not (tmp_path / "run.lock").exists()


def test_without_locks_an_earlier_run_of_the_same_requeued_slurm_job_is_taken_over(tmp_path, no_locks, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    _record(tmp_path, 1, host="node-that-died", slurm_job="4242")
    with run_directory_lock(tmp_path) as notices:
        assert notices == [f"taking over {tmp_path} from pid 1 on node-that-died (started 2026-01-02 03:04:05, SLURM "
                           "job 4242), which ended without releasing it"]


@pytest.mark.slow
def test_a_second_start_is_refused_while_the_first_runs_and_works_after_it(tmp_path):
    args = [*TINY, "trainer.max_steps=100000", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"]
    first = popen_train(args)
    deadline = time.monotonic() + 240
    while not (tmp_path / "metrics.jsonl").is_file() or not read_metrics(tmp_path):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
        time.sleep(0.1)
    config = (tmp_path / ".hydra" / "config.yaml").read_bytes()
    second = run_train([*args[:-1], "trainer.steps_this_run=1", f"hydra.run.dir={tmp_path}"])
    assert second.returncode == 2
    assert second.stderr.strip().startswith(f"error: {tmp_path} is in use by another run, pid {first.pid} on ")
    assert len(second.stderr.strip().splitlines()) == 1
    assert (tmp_path / ".hydra" / "config.yaml").read_bytes() == config  # nothing recorded by the refused start
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr[-3000:]
    assert not (tmp_path / "run.lock").exists()
    third = run_train([*args[:-1], "trainer.steps_this_run=1", f"hydra.run.dir={tmp_path}"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert "taking over" not in third.stdout  # the first released its lock
