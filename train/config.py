"""Typed config schema (registered with Hydra) and the checks that run before any worker starts."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from conf.checks import ConfigError
from data import check_data, data_schemas


class Precision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class WandbMode(str, Enum):
    disabled = "disabled"
    offline = "offline"
    online = "online"


@dataclass
class TaskConfig:
    name: str = MISSING  # a task in train/tasks (bert_pretraining)


@dataclass
class ScheduleConfig:
    name: str = MISSING  # poly_warmup | linear_warmup_cosine | constant
    kwargs: dict[str, Any] = field(default_factory=dict)  # the schedule's own arguments


@dataclass
class PrecisionConfig:
    dtype: Precision = MISSING  # autocast dtype; fp16 adds a GradScaler
    init_scale: float | None = MISSING  # fp16 loss scale at the start (null without loss scaling)
    growth_interval: int | None = MISSING  # fp16 steps without overflow before the scale doubles


@dataclass
class TrainerConfig:
    """Types only: the values and their meaning are in conf/trainer/default.yaml."""

    seed: int = MISSING
    max_steps: int | None = MISSING
    epochs: float | None = MISSING
    global_batch_size: int = MISSING
    micro_batch_size: int = MISSING
    grad_clip: float = MISSING
    device: str = MISSING
    nproc_per_node: int = MISSING
    backend: str = MISSING
    log_every: int = MISSING
    eval_every: int = MISSING
    checkpoint_every: int = MISSING
    keep_last: int = MISSING
    resume: bool = MISSING
    steps_this_run: int | None = MISSING
    init_from: str | None = MISSING
    compile: bool = MISSING
    ema_decay: float | None = MISSING
    best_metric: str | None = MISSING
    best_metric_mode: str = MISSING
    keep_best: int = MISSING


@dataclass
class LoggerConfig:
    progress_bar: bool = MISSING
    tensorboard: bool = MISSING
    wandb: WandbMode = MISSING
    wandb_project: str = MISSING


@dataclass
class Config:
    name: str = MISSING  # run name: the run directory is runs/<name> unless hydra.run.dir says otherwise
    task: TaskConfig = field(default_factory=TaskConfig)
    model: dict[str, Any] = field(default_factory=dict)  # `name` + the builder's keyword arguments
    data: Any = MISSING  # typed by the chosen option's schema (e.g. data/text_schema)
    optim: dict[str, Any] = field(default_factory=dict)  # `name` + the optimizer's keyword arguments
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def _package_path(package: str, relative: str = "") -> str:
    """`${package_path:pkg,sub}`: a directory inside an installed package (offline model files, say)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ConfigError(f"package '{package}' is not installed (pip install -r requirements.txt)")
    return str(Path(spec.origin).parent / relative)


def register_configs() -> None:
    if not OmegaConf.has_resolver("package_path"):
        OmegaConf.register_new_resolver("package_path", _package_path)
    store = ConfigStore.instance()
    store.store(name="config_schema", node=Config)
    for name, node in data_schemas().items():
        store.store(group="data", name=name, node=node)


@dataclass(frozen=True)
class BatchGeometry:
    """How the global batch splits over ranks and micro-batches."""

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    accumulation_steps: int


def batch_geometry(trainer: TrainerConfig | DictConfig, world_size: int) -> BatchGeometry:
    """Derive accumulation from the global batch; an indivisible combination is an error."""
    per_step = trainer.micro_batch_size * world_size
    if trainer.global_batch_size % per_step:
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by "
            f"trainer.micro_batch_size={trainer.micro_batch_size} x world size {world_size}"
        )
    return BatchGeometry(
        trainer.global_batch_size, trainer.micro_batch_size, world_size, trainer.global_batch_size // per_step
    )


def launch_world_size(cfg: DictConfig) -> int:
    """World size the run will have: from torchrun/srun's environment, else trainer.nproc_per_node."""
    for var in ("WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    return cfg.trainer.nproc_per_node


def _positive(cfg: DictConfig, *keys: str) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is None or value <= 0:
            raise ConfigError(f"{key}={value} must be positive")


def _kwargs_error(kind: str, cfg_node: DictConfig) -> str | None:
    """Check a `name` + kwargs node (model, optim) against its registry before anything is built."""
    if "name" not in cfg_node:
        return f"{kind}.name is missing"
    kwargs = {k: v for k, v in cfg_node.items() if k != "name"}
    if kind == "model":
        from models import model_kwargs_error

        return model_kwargs_error(cfg_node.name, kwargs)
    from optim import check_optimizer_config

    try:
        check_optimizer_config(cfg_node.name, kwargs)
    except ValueError as err:  # conf.checks.ConfigError: one line naming optim.<key>
        return str(err)
    return None


def _check_length(trainer: DictConfig) -> None:
    """Exactly one of max_steps and epochs says how long the run is."""
    if (trainer.max_steps is None) == (trainer.epochs is None):
        raise ConfigError(
            f"trainer.max_steps={trainer.max_steps} and trainer.epochs={trainer.epochs}: set exactly one of them"
        )
    key = "trainer.max_steps" if trainer.max_steps is not None else "trainer.epochs"
    if OmegaConf.select(trainer, key.split(".")[1]) <= 0:
        raise ConfigError(f"{key}={OmegaConf.select(trainer, key.split('.')[1])} must be positive")


def _check_data_classes(cfg: DictConfig) -> None:
    """The data's class count must be the model head's (a cross-group check: data and model)."""
    data_classes, model_classes = OmegaConf.select(cfg, "data.num_classes"), OmegaConf.select(cfg, "model.num_classes")
    if data_classes is not None and model_classes is not None and data_classes != model_classes:
        raise ConfigError(f"data.num_classes={data_classes} differs from model.num_classes={model_classes}")


def _check_ema_and_best(trainer: DictConfig) -> None:
    if trainer.ema_decay is not None and not 0.0 < trainer.ema_decay < 1.0:
        raise ConfigError(f"trainer.ema_decay={trainer.ema_decay} must be in (0, 1) or null")
    if trainer.keep_best < 0:
        raise ConfigError(f"trainer.keep_best={trainer.keep_best} must be >= 0")
    if trainer.keep_best and not (trainer.best_metric or "").startswith("eval/"):
        raise ConfigError(f"trainer.best_metric={trainer.best_metric} must name an eval metric (eval/top1) "
                          "when trainer.keep_best > 0")
    if trainer.best_metric_mode not in ("max", "min"):
        raise ConfigError(f"trainer.best_metric_mode={trainer.best_metric_mode} must be one of max, min")


def validate(cfg: DictConfig) -> BatchGeometry:
    """Fail fast, before workers start, on values that cannot work; return the batch geometry."""
    _check_length(cfg.trainer)
    _positive(cfg, "trainer.global_batch_size", "trainer.micro_batch_size", "trainer.nproc_per_node",
              "trainer.log_every", "trainer.keep_last", "optim.lr")
    for key in ("trainer.checkpoint_every", "trainer.eval_every", "trainer.grad_clip"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be >= 0 (0 disables it)")
    if cfg.trainer.steps_this_run is not None and cfg.trainer.steps_this_run <= 0:
        raise ConfigError(f"trainer.steps_this_run={cfg.trainer.steps_this_run} must be positive or null")
    for key, allowed in (("trainer.device", ("auto", "cpu", "cuda")), ("trainer.backend", ("auto", "gloo", "nccl"))):
        if OmegaConf.select(cfg, key) not in allowed:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)} must be one of {', '.join(allowed)}")
    check_data(cfg.data, cfg.trainer.micro_batch_size)
    _check_data_classes(cfg)
    _check_ema_and_best(cfg.trainer)
    for kind in ("model", "optim"):
        error = _kwargs_error(kind, cfg[kind])
        if error:
            raise ConfigError(error)
    from optim import build_lr_schedule

    try:
        build_lr_schedule(cfg.schedule.name, total_steps=cfg.trainer.max_steps or 1, **cfg.schedule.kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"schedule: {err}") from None
    from train.tasks import get_task

    try:
        get_task(cfg.task.name)
    except ValueError as err:
        raise ConfigError(f"task.name: {err}") from None
    return batch_geometry(cfg.trainer, launch_world_size(cfg))
