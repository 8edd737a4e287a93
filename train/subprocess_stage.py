"""Commands that run other commands as stages (`train.pipeline`, `benchmarks.paper.reproduce`): one way to start a
stage, pass a stop on to it and report the stop.

A stage runs in its own process group, so Ctrl-C at the terminal reaches only the command that started it; that
command passes SIGINT / SIGTERM on to the stage once and waits for it to exit (a `python -m train` stage saves its
stop checkpoint first), then reports the stop in one line. `subprocess.run` would SIGKILL the stage 0.25 s after
the KeyboardInterrupt, before a one-process stage could write its checkpoint.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StageStopped(Exception):
    """A stop signal reached the command while stage `stage` ran; the stage has exited (its work saved)."""

    def __init__(self, signum: int, stage: str) -> None:
        self.signum, self.stage = signum, stage
        super().__init__(f"stopped by {signal.Signals(signum).name} during {stage}; rerun the same command to "
                         "resume it")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a command ended by a signal: 128 + its number (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum


def run_stage(command: Sequence[str], stage: str, **popen: Any) -> subprocess.CompletedProcess:
    """`command` run to its end (`popen`: `subprocess.Popen`'s options); raises `StageStopped` once it has exited
    when SIGINT or SIGTERM reached this process meanwhile (they are passed on to the stage)."""
    received: list[int] = []
    child: subprocess.Popen | None = None

    def pass_on(signum: int, frame: Any) -> None:
        received.append(signum)
        if child is not None and child.returncode is None:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, pass_on) for signum in STOP_SIGNALS}
    try:
        child = subprocess.Popen(command, process_group=0, **popen)
        if received:  # the signal came before the stage existed
            child.send_signal(received[0])
        stdout, stderr = child.communicate()  # retried after each signal handler (PEP 475)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise StageStopped(received[0], stage)
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


@contextlib.contextmanager
def stage_stops_exit() -> Iterator[None]:
    """Around a command's body: a stopped stage becomes its one line on stderr and exit code 130 / 143."""
    try:
        yield
    except StageStopped as stop:
        print(stop, file=sys.stderr)
        sys.exit(stop.exit_code)


_PLAIN_VALUE = re.compile(r"[\w./:+@-]*", re.ASCII)


def override(key: str, value: object) -> str:
    """`key=value` as Hydra's override parser reads back `value` as that string: quoted when it holds a space, a
    non-ASCII letter or another character the parser would refuse or interpret (paths and run names)."""
    text = str(value)
    if _PLAIN_VALUE.fullmatch(text):
        return f"{key}={text}"
    # Inside quotes a backslash is literal except before a quote or the closing quote, where it is doubled.
    escaped = re.sub(r"(\\*)('|$)", lambda m: m[1] * 2 + ("\\" + m[2] if m[2] else ""), text)
    return f"{key}='{escaped}'"
