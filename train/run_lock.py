"""The run directory's lock: one run at a time in a directory, held by the launching process for the run's life.

Two runs in one directory (a requeued job while the old one still runs, the same command in two terminals) would
resume the same checkpoints, and the second's resume would rewrite `metrics.jsonl` under the first. So rank 0
takes an exclusive lock on `<run dir>/run.lock` before it records the config, writes its holder there (host, pid,
start time, SLURM job) for a second start's refusal to name, and removes the file when the run ends, however it
ends.

The lock is a POSIX record lock (`fcntl.lockf`), not a BSD `flock`: the processes a run forks (data loader
workers) do not inherit it, so a dead holder's orphans never keep it, and NFS supports it (v4 natively, v3
through lockd). The kernel drops it with its holder, however that dies (kill -9, a requeued SLURM job, a lost node
once its lease expires), so a record left behind means nothing by itself: the next start takes the lock over and
says whose it was. Where the file system has no locks (some Lustre and NFS mounts), the record alone decides: a
holder that is alive on this host, or that runs on another host outside this SLURM job, refuses the start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from core.atomic import atomic_write_text
from core.errors import UserError
from train.run_dir import RunDir
from train.stop import writing

_HELD = (errno.EACCES, errno.EAGAIN)  # what lockf says when another process holds the lock
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system without locks
_ATTEMPTS = 5  # a holder may remove the file between our open and our lock: try its successor


class RunDirectoryInUse(UserError):
    """Another run holds the run directory (a user error: one line naming it, exit code 2)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run directory's lock, as its lock file records it."""

    host: str
    pid: int
    started: str
    slurm_job: str | None = None

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), time.strftime("%Y-%m-%d %H:%M:%S"),
                   os.environ.get("SLURM_JOB_ID"))

    def __str__(self) -> str:
        job = f", SLURM job {self.slurm_job}" if self.slurm_job else ""
        return f"pid {self.pid} on {self.host} (started {self.started}{job})"

    def has_ended(self) -> bool:
        """Whether the holder is surely gone: a process of this host that no longer exists, or an earlier run of this
        (requeued) SLURM job. A holder on another host may be alive: only a lock can tell."""
        here = Holder.this_process()
        if self.slurm_job is not None and self.slurm_job == here.slurm_job and self.pid != here.pid:
            return True
        return self.host == here.host and not _alive(self.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _read_holder(text: str) -> Holder | None:
    """The holder a lock file records; None for an empty or unreadable record (a start cut short while writing)."""
    try:
        return Holder(**json.loads(text))
    except (ValueError, TypeError):
        return None


@contextlib.contextmanager
def run_directory_lock(run_dir: str | os.PathLike[str]) -> Iterator[list[str]]:
    """Hold the lock of `run_dir` while the block runs, or refuse in one line (`RunDirectoryInUse`) naming its
    holder. Yields the lines to say at start-up (a lock taken over from a holder that ended without releasing it)."""
    path = RunDir(run_dir).lock_file
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, notices = _lock(path)
    except OSError as err:
        if err.errno not in _NO_LOCKS:
            raise
        fd, notices = None, _claim_by_record(path)
    try:
        yield notices
    finally:
        _release(path, fd)


def _lock(path: Path) -> tuple[int, list[str]]:
    """The file descriptor holding `path`'s lock, with our record written in it."""
    for _ in range(_ATTEMPTS):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            if err.errno in _HELD:
                raise RunDirectoryInUse(_in_use(path, holder)) from None
            raise
        if not _is_at(fd, path):  # its holder removed it while we waited for the lock: lock the new one
            os.close(fd)
            continue
        previous = _read_holder(os.pread(fd, 4096, 0).decode(errors="replace"))
        with writing(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(asdict(Holder.this_process())).encode(), 0)
            os.fsync(fd)
        return fd, [] if previous is None else [_taken_over(path, previous)]
    raise RunDirectoryInUse(f"{path.parent} keeps being started and stopped by other processes: try again")


def _claim_by_record(path: Path) -> list[str]:
    """Without locks: the record alone, refused while its holder may be alive (a race between two starts at the
    same instant is not caught)."""
    holder = _read_holder(path.read_text(errors="replace")) if path.is_file() else None
    if holder is not None and not holder.has_ended():
        raise RunDirectoryInUse(f"{_in_use(path, holder)}; this file system has no locks: if that run has ended, "
                                f"remove {path}")
    with writing(path):
        atomic_write_text(path, json.dumps(asdict(Holder.this_process())))
    return [] if holder is None else [_taken_over(path, holder)]


def _release(path: Path, fd: int | None) -> None:
    """Remove the lock file (while still holding it, so no start locks it in between), then let go."""
    with contextlib.suppress(OSError):
        if _is_at(fd, path) if fd is not None else _recorded_here(path):
            path.unlink()
    if fd is not None:
        os.close(fd)  # releases the lock


def _recorded_here(path: Path) -> bool:
    """Whether the lock file records this process (without locks, a later start may have replaced the record)."""
    holder, here = _read_holder(path.read_text(errors="replace")), Holder.this_process()
    return holder is not None and (holder.host, holder.pid) == (here.host, here.pid)


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (here.st_dev, here.st_ino)


def _in_use(path: Path, holder: Holder | None) -> str:
    who = f"another run, {holder}" if holder is not None else "another run"
    return (f"{path.parent} is in use by {who}: wait for it to end or stop it, or pick another name=... for this "
            "run")


def _taken_over(path: Path, holder: Holder) -> str:
    return f"taking over {path.parent} from {holder}, which ended without releasing it"
