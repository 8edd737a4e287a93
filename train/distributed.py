"""Process-group set-up for single process, our own local workers, torchrun and srun alike."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from conf.checks import USER_ERRORS, ReportedError, user_error_line
from optim.comm import Comm
from optim.network import parse_cluster

_USER_ERROR_EXIT_CODE = 2  # as `python -m train` exits on a user error
_SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def launched_externally() -> bool:
    """True under torchrun, srun or our own elastic workers: the environment already describes the world."""
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ


def launch_rank() -> int:
    """This process's rank as torchrun or srun describe it (0 for a single process or the local launcher)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def adopt_slurm_environment() -> None:
    """Map srun's variables onto torch's; MASTER_ADDR/MASTER_PORT come from the job script."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    for slurm, torch_name in _SLURM_TO_TORCH.items():
        os.environ[torch_name] = os.environ[slurm]
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing and int(os.environ["WORLD_SIZE"]) > 1:
        raise RuntimeError(
            f"running under srun without {', '.join(missing)}: export them in the job script "
            "(see docker/slurm.sbatch), e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_NODELIST | head -n1)"
        )


def pick_device(requested: str) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


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
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    return Comm(network=network)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local_workers(entrypoint: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run `entrypoint(*args)` in `nproc` local worker processes with torch's elastic launcher.

    A user error in a worker (a data file only a worker reads, say) ends the run as it would in one process:
    its one line (once, however many workers met it) as a `ReportedError`, not the launcher's traceback.
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
    with tempfile.TemporaryDirectory(prefix="train-user-errors-") as report_dir:
        try:
            elastic_launch(config, _reporting_user_errors)(report_dir, entrypoint, *args)
        except SignalException:
            # SIGTERM / SIGINT reached the launcher, which passed it on to the workers and waited for them: they
            # stopped with a checkpoint. A scheduler's notice is not a failure of the run.
            return
        except ChildFailedError:
            reports = sorted(Path(report_dir).iterdir())  # rank order
            if not reports:
                raise  # a crash, not a user error: the launcher's report and the workers' tracebacks
            raise ReportedError("\n".join(dict.fromkeys(p.read_text() for p in reports))) from None


def _reporting_user_errors(report_dir: str, entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A local worker: `entrypoint(*args)`, leaving a user error's line in `report_dir` for the launcher."""
    try:
        return entrypoint(*args)
    except USER_ERRORS as error:
        rank = int(os.environ.get("RANK", 0))
        (Path(report_dir) / f"rank_{rank:05d}.txt").write_text(user_error_line(error))
        sys.exit(_USER_ERROR_EXIT_CODE)
