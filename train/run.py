"""`run(cfg)`: validate, pick the run directory, start workers if asked, and train."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from train.config import validate
from train.distributed import (
    adopt_slurm_environment,
    init_distributed,
    launch_local_workers,
    launched_externally,
    pick_device,
    shutdown_distributed,
)


def run(cfg: DictConfig, run_dir: str | Path) -> None:
    """Train as configured. Raises ConfigError (before any worker starts) for values that cannot work."""
    validate(cfg)
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # plain values: picklable
    nproc = cfg.trainer.nproc_per_node
    if nproc > 1 and not launched_externally():
        launch_local_workers(train_worker, nproc, config, str(run_dir))
    else:
        train_worker(config, str(run_dir))


def train_worker(config: dict[str, Any], run_dir: str) -> None:
    """One rank's life: join the group, agree on the run directory, train, clean up."""
    from train.trainer import Trainer

    cfg = OmegaConf.create(config)
    adopt_slurm_environment()
    comm = init_distributed(cfg.trainer.backend, pick_device(cfg.trainer.device))
    try:
        # Rank 0's directory wins, so ranks that resolved their own (a ${now:} in it, say) still agree.
        shared_dir = Path(str(comm.broadcast_object(run_dir)))
        trainer = Trainer(cfg, shared_dir, comm)
        try:
            trainer.fit()
        finally:
            trainer.close()
    finally:
        shutdown_distributed()
