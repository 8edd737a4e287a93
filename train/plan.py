"""`RunPlan`: the run as the launching process checked and resolved it, the one thing its workers build from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import ConfigError
from data import DataRequest, build_data
from optim.schedule import ScheduleConfig
from train.config import BatchGeometry, TrainerConfig, validate
from train.distributed import check_local_workers
from train.metrics import LoggerConfig
from train.model_init import check_init_from, optimizer_checkpoint
from train.precision import PrecisionConfig
from train.run_dir_check import check_run_directory
from train.tasks import TaskConfig


@dataclass(frozen=True)
class Choice:
    """A registry name and the keyword arguments its builder takes, complete and checked (a model, say)."""

    name: str
    options: dict[str, Any]  # `name` left out


@dataclass(frozen=True)
class OptimizerChoice(Choice):
    """An optimizer's name and options, final: `build_optimizer(..., checked=True)` takes them as they are."""

    @property
    def lr(self) -> float:
        """An optimizer's peak LR (`optim.lr`): the one copy the schedule scales at every step."""
        return float(self.options["lr"])


@dataclass(frozen=True)
class RunPlan:
    """Every value a worker needs, checked once, in plain (picklable) values: it crosses the spawn boundary.

    Workers build from it and check nothing again; they only confirm they are as many as it was planned for. Each
    group's values come as that group's own schema (`TrainerConfig`, `PrecisionConfig`, ...), filled in; `config`
    is the record alone (metrics, summary, wandb): nothing is built from it.
    """

    run_dir: Path
    geometry: BatchGeometry  # planned for the launch's world size (torchrun's, srun's, or trainer.nproc_per_node)
    model: Choice
    optimizer: OptimizerChoice
    init_checkpoint: Path | None  # the checkpoint whose optimizer state this run continues (init_optimizer_state)
    # trainer.max_steps is None with trainer.epochs: an epoch's steps depend on the data's size, which a worker reads.
    trainer: TrainerConfig
    precision: PrecisionConfig
    schedule: ScheduleConfig
    logger: LoggerConfig
    task: TaskConfig
    data: Any  # the data kind's schema (`data.data_schemas()`), filled in
    config: dict[str, Any]  # the resolved config in plain values: the run's record, not read to build anything
    notices: tuple[str, ...] = ()  # lines for rank 0 to say at start-up (the launching process has no log of its own)

    def data_config(self) -> DictConfig:
        """The data kind's values as its builder (`data.build_data`) takes them."""
        return OmegaConf.structured(self.data)

    def data_request(self, rank: int, *, pin_memory: bool = False) -> DataRequest:
        """What rank `rank` asks of the data."""
        return DataRequest(rank=rank, world_size=self.geometry.world_size,
                           micro_batch_size=self.geometry.micro_batch_size, seed=self.trainer.seed,
                           pin_memory=pin_memory)

    def confirm_world_size(self, world_size: int) -> None:
        """Refuse, in one line, a process group of another size than planned: the batch split would not hold."""
        planned = self.geometry.world_size
        if world_size != planned:
            raise ConfigError(f"this run was planned for {planned} rank(s) (trainer.nproc_per_node, or the "
                              f"launcher's WORLD_SIZE / SLURM_NTASKS) but its process group has {world_size}: start "
                              f"it with {planned} rank(s), or let each rank plan it (python -m train)")


def plan_run(cfg: DictConfig, run_dir: str | Path, notices: tuple[str, ...] = ()) -> RunPlan:
    """Check every value (`validate`) and the init weights' fit, resolve the init checkpoint, and freeze the result
    for the workers, with the `notices` the launching process has for the run's log; then check what the launch
    needs: the local workers' count, the data's files (a dry build) and the checkpoints already in `run_dir`.

    Raises a `UserError` in one line: `ConfigError` naming the key of a value that cannot work, a missing data
    file, or `RunDirectoryError` for checkpoints this run must not or cannot continue.
    """
    plan = _resolve(cfg, Path(run_dir), notices)
    check_local_workers(plan.trainer.nproc_per_node, plan.trainer.device)
    build_data(plan.data_config(), plan.data_request(rank=0), dry=True)  # paths and keys only: nothing is read
    check_run_directory(plan)
    return plan


def _resolve(cfg: DictConfig, run_dir: Path, notices: tuple[str, ...]) -> RunPlan:
    """The values checked (`validate`) and frozen into the plan."""
    checked = validate(cfg)
    trainer = cfg.trainer
    init_checkpoint = None
    if trainer.init_optimizer_state:  # or a one-line refusal
        init_checkpoint = optimizer_checkpoint(trainer.init_from, cfg.optim.name, checked.geometry.world_size)
    if trainer.init_from:  # what loads and what starts fresh: a line for the run's log
        init_line = check_init_from(cfg.model.name, checked.model_options, trainer.init_from)
        notices = (*notices, init_line) if init_line is not None else notices
    group = OmegaConf.to_object  # a group's node as its schema's dataclass, interpolations resolved
    return RunPlan(
        run_dir=run_dir, geometry=checked.geometry,
        model=Choice(cfg.model.name, checked.model_options),
        optimizer=OptimizerChoice(cfg.optim.name, checked.optimizer_options),
        init_checkpoint=init_checkpoint,
        trainer=group(cfg.trainer), precision=group(cfg.precision), schedule=group(cfg.schedule),
        logger=group(cfg.logger), task=group(cfg.task), data=group(cfg.data),
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True), notices=tuple(notices),
    )
