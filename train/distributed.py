"""Process-group set-up for single process, our own local workers, torchrun and srun alike."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from core.errors import USER_ERRORS, ConfigError, ReportedError, user_error_line
from optim.comm import Comm
from optim.network import parse_cluster
from train.stop import RunStopped

_USER_ERROR_EXIT_CODE = 2  # as `python -m train` exits on a user error
# The launcher's loggers: on a worker's death they log the worker's traceback, or a traceback of their own for a kill,
# over several lines each; `WorkerDied` says it in one.
_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")
_SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def in_srun_step() -> bool:
    """True inside an srun step, whose tasks carry SLURM_STEP_ID (SLURM_STEPID before Slurm 20.11).

    sbatch's batch shell has SLURM_PROCID=0 and SLURM_NTASKS too but no step id, and a `python -m train` there
    must start its own workers: only srun's tasks are a world that SLURM_PROCID/SLURM_NTASKS describe.
    """
    step = os.environ.get("SLURM_STEP_ID", os.environ.get("SLURM_STEPID", ""))
    return "SLURM_PROCID" in os.environ and step.isdigit()


def environment_world_size() -> int | None:
    """The world size torchrun (WORLD_SIZE) or an srun step (SLURM_NTASKS) describes; None when neither does."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if in_srun_step():
        return int(os.environ.get("SLURM_NTASKS", 1))
    return None


def launched_externally() -> bool:
    """True under torchrun, an srun step or our own elastic workers: the environment already describes the world."""
    return "RANK" in os.environ or in_srun_step()


def launch_rank() -> int:
    """This process's rank as torchrun or srun describe it (0 for a single process or the local launcher)."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return int(os.environ["SLURM_PROCID"]) if in_srun_step() else 0


def adopt_slurm_environment() -> None:
    """Map an srun step's variables onto torch's; MASTER_ADDR/MASTER_PORT come from the job script."""
    if "RANK" in os.environ or not in_srun_step():
        return
    for slurm, torch_name in _SLURM_TO_TORCH.items():
        os.environ[torch_name] = os.environ[slurm]
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing and int(os.environ["WORLD_SIZE"]) > 1:
        raise RuntimeError(
            f"running under srun without {', '.join(missing)}: export them in the job script "
            "(see docker/slurm.sbatch), e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -n1)"
        )


def check_local_workers(nproc: int, requested_device: str) -> None:
    """Refuse, before any worker starts, a `trainer.nproc_per_node` that would be ignored or cannot get a GPU each."""
    if nproc > 1 and launched_externally():
        launcher = "torchrun (RANK is set)" if "RANK" in os.environ else "srun (SLURM_STEP_ID is set)"
        raise ConfigError(
            f"trainer.nproc_per_node={nproc}, but this process was started by {launcher}, which decides the "
            "number of workers: set trainer.nproc_per_node=1 and give the count to the launcher "
            "(torchrun --nproc-per-node, srun --ntasks-per-node), or run python -m train outside it"
        )
    if _uses_cuda(requested_device) and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.nproc_per_node={nproc} workers, one per GPU, but this node has {torch.cuda.device_count()} "
            "visible CUDA device(s): set trainer.nproc_per_node to at most that (or check CUDA_VISIBLE_DEVICES)"
        )


def _uses_cuda(requested: str) -> bool:
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def pick_device(requested: str) -> torch.device:
    """This worker's device: the one GPU it sees (srun --gpus-per-task, GPU binding), else its LOCAL_RANK's."""
    if not _uses_cuda(requested):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible: use trainer.device=auto or cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} but this process sees only {count} CUDA devices: start at most {count} "
            "workers per node (trainer.nproc_per_node, or the launcher's --nproc-per-node / --ntasks-per-node), "
            "or give each task one GPU (srun --gpus-per-task=1)"
        )
    return torch.device("cuda", local_rank)


def init_distributed(backend: str, device: torch.device, timeout_minutes: float = 30.0,
                     simulated_network: str | None = None) -> Comm:
    """Join the process group described by the environment (if any) and return the communication layer.

    `simulated_network` (`trainer.simulated_network`, e.g. `10gbe` or `ib100:8`) makes the layer's algorithm
    collectives last at least as long as that network would take (`optim.network`).
    """
    network = parse_cluster(simulated_network) if simulated_network is not None else None
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return Comm(network=network)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    # Binding the group to this rank's GPU lets NCCL's barriers and communicator set-up use it, instead of
    # guessing a device from the rank (a warning, and a hang when the guess is another rank's GPU).
    device_id = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device_id = device
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes), device_id=device_id)
    return Comm(network=network)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_worker_threads(nproc: int, environ: Mapping[str, str], cores: int) -> int | None:
    """Intra-op threads for each of `nproc` workers on one machine: their share of its cores, at least one.

    Each process's torch would otherwise take every core, and the workers' OpenMP threads would spin against each
    other: two concurrent MiniLM fine-tunings on a 2-core machine took 3x as long with 2 threads each as with 1.
    None (torch's own choice) where the user set OMP_NUM_THREADS.
    """
    if "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores // nproc)


def visible_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class WorkerDied(RunStopped):
    """A local worker died (killed, or crashed with its traceback printed before): the run stops with one line
    naming it, instead of the launcher's report of several dozen. Exit code 1: not a value the user must change."""

    exit_code = 1


def launch_local_workers(entrypoint: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run `entrypoint(*args)` in `nproc` local worker processes with torch's elastic launcher.

    The workers share the machine's cores (`local_worker_threads`). A user error in a worker (a data file only a
    worker reads, say) ends the run as it would in one process: its one line (once, however many workers met it)
    as a `ReportedError`, not the launcher's traceback. A worker that dies otherwise is `WorkerDied`.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"local-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    threads = local_worker_threads(nproc, os.environ, visible_cores())
    with (tempfile.TemporaryDirectory(prefix="train-user-errors-") as report_dir, _signal_handlers_kept(),
          _launcher_logs_quiet()):
        try:
            elastic_launch(config, _local_worker)(report_dir, threads, entrypoint, *args)
        except SignalException:
            # SIGTERM / SIGINT reached the launcher, which passed it on to the workers and waited for them: they
            # stopped with a checkpoint. A scheduler's notice is not a failure of the run.
            return
        except ChildFailedError as failed:
            reports = sorted(Path(report_dir).iterdir())  # rank order
            if not reports:
                died, traceback = _worker_died(failed)
                print(traceback, end="", file=sys.stderr, flush=True)  # a crash's report (a bug's), from the worker
                raise died from None
            raise ReportedError("\n".join(dict.fromkeys(p.read_text() for p in reports))) from None


def _worker_died(failed: Any) -> tuple[WorkerDied, str]:
    """The worker whose death stopped the others, in one line (its rank, and its signal or exit code), with the
    traceback of a crash ("" for a kill). A killed worker is the cause where there is one: the others it left in a
    collective fail after it, within the second that orders `ChildFailedError`'s failures."""
    killed = [(rank, failure) for rank, failure in failed.failures.items() if failure.exitcode < 0]
    rank, failure = killed[0] if killed else failed.get_first_failure()
    error = failure.message if isinstance(failure.message, dict) else {}
    traceback = error.get("extraInfo", {}).get("py_callstack", "")
    if failure.exitcode < 0:
        name = failure.signal_name()
        oom = " (the kernel's out-of-memory killer sends it: see dmesg)" if name == "SIGKILL" else ""
        how = f"was killed by {name}{oom}"
    else:
        message = str(error.get("message", "")).strip().splitlines()
        how = f"failed with exit code {failure.exitcode}" + (f" ({message[-1]})" if message else "")
    return WorkerDied(f"worker rank {rank} (pid {failure.pid}) {how}, and the run stopped: rerun the same command to "
                      "resume from its newest checkpoint"), traceback


@contextlib.contextmanager
def _launcher_logs_quiet() -> Iterator[None]:
    """The launcher's own log records off while it runs: `launch_local_workers` reports what they would say (torch
    gives some of its loggers a level of their own, so each is set, not only their parents)."""
    names = [name for name in logging.Logger.manager.loggerDict if name.startswith(_LAUNCHER_LOGGERS)]
    loggers = [logging.getLogger(name) for name in {*_LAUNCHER_LOGGERS, *names}]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The process's stop-signal handlers as they were: torch's launcher installs its own (which raise
    `SignalException`) and leaves them, so a later Ctrl-C in the same process would no longer be a
    KeyboardInterrupt."""
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    previous = {signum: signal.getsignal(signum) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: installed outside Python, left as it is
                signal.signal(signum, handler)


def _local_worker(report_dir: str, threads: int | None, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A local worker: `entrypoint(*args)` on `threads` intra-op threads (None: torch's choice), leaving a user
    error's line in `report_dir` for the launcher."""
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return entrypoint(*args)
    except USER_ERRORS as error:
        rank = int(os.environ.get("RANK", 0))
        (Path(report_dir) / f"rank_{rank:05d}.txt").write_text(user_error_line(error))
        sys.exit(_USER_ERROR_EXIT_CODE)
