"""Stop requests: SIGTERM (a scheduler's notice) and SIGINT (Ctrl-C), agreed by every rank between micro-batches.

A step with many accumulation micro-batches can last minutes, longer than the notice a scheduler gives, so a
request is honoured at the next micro-batch boundary, not the next optimizer step: the loop abandons the
partial step and saves the last completed one. Every rank must abandon the same micro-batch, or one would
wait forever in the gradient all-reduce of a step the others left. So ranks vote at each boundary over a
host-side group and act on the previous boundary's result: one micro-batch of latency, and no wait for the
device or for slower ranks on the hot path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from core.errors import UserError
from optim.comm import Comm, PendingVote

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunStopped(UserError):
    """An error that stopped a run (a non-finite loss, a full disk), recorded in its summary.json and train.log:
    reported as its one line, with no traceback, like a user error."""


class DiskFull(RunStopped):
    """A write that found no space left, naming what it was writing (a write to an open file names nothing)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(f"no space left on device writing {path}")


def is_disk_full(error: BaseException | None) -> bool:
    """Whether `error` is a full disk or was raised while handling one: `torch.save` reports it as a RuntimeError
    ("unexpected pos") raised over the OSError(ENOSPC) of its write."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DiskFull) or (isinstance(error, OSError) and error.errno == errno.ENOSPC):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Around a write of `path`: a full disk becomes `DiskFull` naming it, in one line."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as error:
        if is_disk_full(error):
            raise DiskFull(path) from None
        raise


class StopRequest:
    """While entered, SIGTERM and SIGINT request a stop instead of killing the process."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.signal_name: str | None = None  # the signal this process received, if any
        self._vote: PendingVote | None = None
        self._previous_handlers: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        self._previous_handlers = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        if kind is None and self._vote is not None:
            self._vote.result()  # every rank posted it: collect it so no collective is left in flight

    def agreed(self) -> bool:
        """Called at every micro-batch boundary, on every rank: true once all ranks are to stop here.

        A single process acts on its own signal at once; ranks act on the vote of the previous boundary.
        """
        if not self.comm.distributed:
            return self.signal_name is not None
        agreed = self._vote is not None and self._vote.result()
        self._vote = None if agreed else self.comm.any_later(self.signal_name is not None)
        return agreed

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
