"""One `log(metrics, step)` interface over the progress bar, a JSONL metrics file, TensorBoard and wandb, and the
run's clock and totals that every record and the run's summary are stamped from.

Only rank 0 writes; other ranks get a logger whose methods do nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING
from tqdm import tqdm

from core.atomic import atomic_write_text
from core.errors import UserError
from train.run_dir import RunDir
from train.stop import writing

log = logging.getLogger(__name__)


class WandbMode(str, Enum):
    disabled = "disabled"
    offline = "offline"
    online = "online"


@dataclass
class LoggerConfig:
    """Schema of conf/logger/*.yaml (the values and their meaning are there)."""

    progress_bar: bool = MISSING
    tensorboard: bool = MISSING
    wandb: WandbMode = MISSING
    wandb_project: str = MISSING


class RunClock:
    """Seconds of training since the run started, continued across resumes (its state is in the checkpoint).

    A resumed run continues from the elapsed time of the checkpoint it resumes from: the time a killed run spent
    past its last checkpoint is not counted, just as the steps it took there are redone.
    """

    def __init__(self) -> None:
        self._start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def state_dict(self) -> dict[str, float]:
        return {"elapsed": self.elapsed()}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._start = time.monotonic() - state["elapsed"]


@dataclass
class RunTotals:
    """What the run has done since step 0, continued across resumes (it is in the checkpoint): summed per step, so
    means over the whole run are exact, not averages of the log windows."""

    iterations: int = 0  # optimizer steps tried, fp16-overflow (skipped) ones included
    samples: int = 0  # sequences or images, all ranks together
    bytes: int = 0  # sent by this rank (rank 0's are logged) through optim.comm
    collectives: int = 0
    seconds: float = 0.0  # wall time of the training loop (evaluations and checkpoints between steps included)
    replica_average_bytes: int = 0  # sent by this rank to average drifted replicas for evaluations and exports

    def add(self, counts: dict[str, int], samples: int, seconds: float) -> None:
        """One optimizer step's `Comm.take_counts()`, its samples and its seconds."""
        self.iterations += 1
        self.samples += samples
        self.bytes += counts["bytes"]
        self.collectives += counts["collectives"]
        self.seconds += seconds

    def since(self, earlier: RunTotals) -> RunTotals:
        """The totals of the steps between `earlier` (a copy taken then) and now: a log window's sums."""
        return RunTotals(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)


_BAR_KEYS = {"loss": "loss", "lr": "lr", "seq_per_s": "seq/s", "comm_bytes_per_step": "B/step"}


def record_line(record: dict[str, Any], total_steps: int) -> str:
    """A training record as one line of a log: step, loss, LR, throughput, bytes sent per step, elapsed time."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if "lr" in record:
        parts.append(f"lr {record['lr']:.3g}")
    if "seq_per_s" in record:
        parts.append(f"{record['seq_per_s']:.1f} samples/s")
    if "tokens_per_seq" in record:  # BERT: real (non-pad) tokens, the throughput padding does not inflate
        parts.append(f"{record['seq_per_s'] * record['tokens_per_seq']:.0f} tokens/s")
    if "comm_bytes_per_step" in record:
        parts.append(f"{format_bytes(record['comm_bytes_per_step'])} sent/step")
    minutes, seconds = divmod(round(record["elapsed"]), 60)
    parts.append(f"elapsed {minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
    return " | ".join(parts)


def format_bytes(count: float) -> str:
    """A byte count in decimal units (1.5 MB), as network and storage figures are quoted."""
    unit = "B"
    for larger in ("kB", "MB", "GB"):
        if count < 1000:
            break
        count, unit = count / 1000, larger
    return f"{count:.0f} B" if unit == "B" else f"{count:.3g} {unit}"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The metric records of a run, one dict per logged step.

    A cut last line (a crash or a full disk mid-write) is dropped with a warning: the steps it recorded are redone
    on resume. A bad line before the last is damage no crash leaves: a `UserError` naming the file and line.
    """
    path = RunDir(run_dir).metrics_file
    if not path.exists():
        return []
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index < len(lines) - 1:
                raise UserError(f"{path} line {number} is not a JSON record: repair or remove that line") from None
            log.warning("warning: %s ends in a cut record (line %d), dropped", path, number)
    return records


class MetricLogger:
    def __init__(
        self,
        run_dir: RunDir,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress_bar: bool,
        tensorboard: bool,
        wandb_mode: str,
        wandb_project: str,
        config: dict[str, Any],
        clock: RunClock | None = None,
    ) -> None:
        self.enabled = enabled
        self.clock = clock or RunClock()  # stamps every record's `elapsed`
        self.path = run_dir.metrics_file
        self._bar = self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        self._file = open(self.path, "a")  # noqa: SIM115 - lives as long as the run
        self._log_file = open(run_dir.log_file, "a")  # noqa: SIM115 - lives as long as the run
        self.total_steps = total_steps
        # A bar redrawn in a batch log (SLURM, a pipe) is noise: only on a terminal. Elsewhere every training record
        # becomes one line, so a job's log shows the loss.
        if progress_bar and sys.stderr.isatty() and sys.stdout.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir.tensorboard_dir), purge_step=start_step + 1)
            _leave_writer_errors_to_the_training_thread()
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        # Started at the first record: a rerun that has nothing to do starts no wandb run.
        self._wandb_start = None if mode == "disabled" else dict(
            project=wandb_project, dir=str(run_dir.path), mode=mode, config=config,
            name=run_dir.display_name(), resume="allow", id=wandb_run_id(run_dir),
        )

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records of steps the run is about to redo, so the file is one clean series."""
        if not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path.parent) if r["step"] <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        # Wall-clock time and training time, for plots against time and the time to reach a target loss.
        record = {"step": step, "time": time.time(), "elapsed": self.clock.elapsed(), **metrics}
        with writing(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():  # eval/top1 stays eval/top1; loss becomes train/loss
                self._tb.add_scalar(key if "/" in key else f"train/{key}", value, step)
        if self._wandb_start is not None and self._wandb is None:
            import wandb

            # Quiet: wandb's banner and summary would bury the run's own closing lines (its files are in the run dir).
            self._wandb = wandb.init(**self._wandb_start, settings=wandb.Settings(silent=True))
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "loss" not in metrics:  # an evaluation: the trainer says its results in a line of its own
            return
        if self._bar is not None:
            self._bar.set_postfix(
                {label: f"{metrics[key]:.4g}" for key, label in _BAR_KEYS.items() if key in metrics}, refresh=False
            )
        self._line(record_line(record, self.total_steps), console=self._bar is None)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def info(self, message: str) -> None:
        """A line for the user, printed above the progress bar and kept in the run's log file."""
        if self.enabled:
            self._line(message, console=True)

    def _line(self, message: str, *, console: bool) -> None:
        if console and self._bar is not None:
            tqdm.write(message)  # above the bar
        elif console:
            # Flushed: a batch job's stdout is a file, buffered by the block. And not through tqdm, whose write lock
            # is a multiprocessing semaphore that a worker leaving with os._exit (train.run) would leak.
            sys.stdout.write(message + "\n")
            sys.stdout.flush()
        with writing(self._log_file.name):
            self._log_file.write(log_line(message))
            self._log_file.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        for file in (self._file, self._log_file):
            # Every write is flushed at once, so a close fails only on a record whose flush failed already and
            # stopped the run with its line: that error, not the repeat, is the run's.
            with contextlib.suppress(OSError):
                file.close()
        self.enabled = False


def log_line(message: str) -> str:
    """`message` as a line of train.log: stamped with the local time."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n"


def _leave_writer_errors_to_the_training_thread() -> None:
    """TensorBoard's writer thread dies on a write error (a full or unwritable run directory) and prints its
    traceback; its next write re-raises that error in the training thread, which stops the run with the error's one
    line. So the thread's own report, which would bury that line, is left out; other threads' are not."""
    previous = threading.excepthook
    if getattr(previous, "leaves_writer_errors", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":  # tensorboard.summary.writer.event_file_writer
            previous(args)

    hook.leaves_writer_errors = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def wandb_run_id(run_dir: RunDir) -> str:
    """The run's wandb id, drawn at random on its first start and kept in the run directory: a resume continues the
    same wandb run, and no other run (a directory of the same name in another checkout or image) shares it."""
    path = run_dir.wandb_id_file
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    atomic_write_text(path, run_id + "\n")
    return run_id
