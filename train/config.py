"""The root config schema (registered with Hydra) and `validate`: every group's own check, then the checks that
span groups, all at compose time, before any worker starts.

Each group's schema and check live beside the code that owns it (data kinds in `data/`, optimizers and schedules
in `optim/`, models in `models/`, tasks, precision and logging in `train/`); this module only lists them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from core.errors import ConfigError
from core.options import (
    InvalidOption,
    check_choice,
    check_non_negative,
    check_positive,
    options_of,
    refuse_unknown_keys,
    require,
)
from data import check_data, data_schemas
from models import check_model_config, compiles_by_regions
from optim import check_optimizer_config, get_optimizer_spec
from optim.comm import WIRE_DTYPES
from optim.network import parse_cluster
from optim.schedule import ScheduleConfig, check_schedule_config
from train.distributed import environment_world_size
from train.help import experiment_list, group_options
from train.metrics import LoggerConfig
from train.precision import PrecisionConfig, check_precision_config
from train.run_dir import check_run_name
from train.tasks import TaskConfig, check_task_config

__all__ = ["BatchGeometry", "Checked", "Config", "ConfigError", "TrainerConfig", "batch_geometry", "register_configs",
           "validate"]


@dataclass
class TrainerConfig:
    """Types only: the values and their meaning are in conf/trainer/default.yaml."""

    seed: int = MISSING
    max_steps: int | None = MISSING
    epochs: float | None = MISSING
    global_batch_size: int = MISSING
    micro_batch_size: int | None = MISSING
    max_micro_batch_size: int = MISSING
    grad_clip: float = MISSING
    grad_allreduce_dtype: str = MISSING
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
    init_optimizer_state: bool = MISSING
    compile: bool = MISSING
    deterministic: bool = MISSING
    ema_decay: float | None = MISSING
    best_metric: str | None = MISSING
    best_metric_mode: str = MISSING
    keep_best: int = MISSING
    simulated_network: str | None = MISSING


@dataclass
class Config:
    name: str = MISSING  # run name: the run directory is runs/<name> unless hydra.run.dir says otherwise
    task: TaskConfig = field(default_factory=TaskConfig)
    model: dict[str, Any] = field(default_factory=dict)  # `name` + the builder's keyword arguments
    data: Any = MISSING  # typed by the chosen data kind's schema (data.data_schemas())
    optim: dict[str, Any] = field(default_factory=dict)  # `name` + the optimizer's keyword arguments
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def _package_path(package: str, relative: str = "") -> str:
    """`${package_path:pkg,sub}`: a directory inside an installed package (offline model files, say)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ConfigError(f"package '{package}' is not installed: pip install -r requirements-dev.txt (demo "
                          "model packages are left out of the container image)")
    return str(Path(spec.origin).parent / relative)


def register_configs() -> None:
    if not OmegaConf.has_resolver("package_path"):
        OmegaConf.register_new_resolver("package_path", _package_path)
    if not OmegaConf.has_resolver("help_groups"):  # --help's group options (conf/hydra/help/slamb.yaml)
        OmegaConf.register_new_resolver("help_groups", group_options)
    if not OmegaConf.has_resolver("help_experiments"):  # --help's experiments (conf/hydra/help/slamb.yaml)
        OmegaConf.register_new_resolver("help_experiments", experiment_list)
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
    """Derive accumulation from the global batch, and the micro-batch too when it is not set.

    An unset (null) micro-batch is the largest divisor of the per-rank batch up to `max_micro_batch_size`, so
    the same command runs on any number of ranks; a set one that does not divide is an error suggesting one.
    """
    global_batch, micro = trainer.global_batch_size, trainer.micro_batch_size
    if global_batch % world_size:
        raise ConfigError(f"trainer.global_batch_size={global_batch} is not divisible by the world size {world_size}")
    per_rank = global_batch // world_size
    largest_fitting = max(d for d in range(1, min(per_rank, trainer.max_micro_batch_size) + 1) if per_rank % d == 0)
    if micro is None:
        micro = largest_fitting
    elif per_rank % micro:
        suggestion = max(d for d in range(1, min(per_rank, micro) + 1) if per_rank % d == 0)
        raise ConfigError(
            f"trainer.global_batch_size={global_batch} is not divisible by trainer.micro_batch_size={micro} x "
            f"world size {world_size}: try trainer.micro_batch_size={suggestion} (or null to derive it)"
        )
    return BatchGeometry(global_batch, micro, world_size, per_rank // micro)


@dataclass(frozen=True)
class Checked:
    """What `validate` derived on the way, so that nothing derives it again (`train.plan` plans the run with it)."""

    geometry: BatchGeometry
    model_options: dict[str, Any]  # the model's keyword arguments, `name` left out
    optimizer_options: dict[str, Any]  # complete, as checked: class signature, registry defaults, config


def launch_world_size(cfg: DictConfig) -> int:
    """World size the run will have: from torchrun's or an srun step's environment, else trainer.nproc_per_node."""
    described = environment_world_size()
    return cfg.trainer.nproc_per_node if described is None else described


def check_trainer_config(trainer: DictConfig) -> None:
    """The trainer group's own values (raises `InvalidOption` with the bare key)."""
    require((trainer.max_steps is None) != (trainer.epochs is None), "max_steps", trainer.max_steps,
            f"and trainer.epochs={trainer.epochs}: set exactly one of them")
    if trainer.max_steps is not None:
        check_positive("max_steps", trainer.max_steps)
    else:
        check_positive("epochs", trainer.epochs)
    for key in ("global_batch_size", "max_micro_batch_size", "nproc_per_node", "log_every", "keep_last"):
        check_positive(key, trainer[key])
    if trainer.micro_batch_size is not None:
        check_positive("micro_batch_size", trainer.micro_batch_size)
    for key in ("checkpoint_every", "eval_every", "grad_clip", "keep_best"):
        check_non_negative(key, trainer[key])
    if trainer.steps_this_run is not None:
        check_positive("steps_this_run", trainer.steps_this_run)
    check_choice("grad_allreduce_dtype", trainer.grad_allreduce_dtype, tuple(WIRE_DTYPES))
    check_choice("device", trainer.device, ("auto", "cpu", "cuda"))
    require(trainer.device != "cuda" or torch.cuda.is_available(), "device", trainer.device,
            "but no CUDA device is visible (or the driver is too old for this torch): use trainer.device=auto or cpu")
    check_choice("backend", trainer.backend, ("auto", "gloo", "nccl"))
    if trainer.ema_decay is not None:
        require(0.0 < trainer.ema_decay < 1.0, "ema_decay", trainer.ema_decay, "must be in (0, 1) or null")
    if trainer.keep_best:
        require((trainer.best_metric or "").startswith("eval/"), "best_metric", trainer.best_metric,
                "must name an eval metric (eval/top1) when trainer.keep_best > 0")
    check_choice("best_metric_mode", trainer.best_metric_mode, ("max", "min"))
    if trainer.simulated_network is not None:
        try:
            parse_cluster(trainer.simulated_network)
        except ValueError as err:
            raise InvalidOption("simulated_network", str(err), trainer.simulated_network) from None


def _options(node: DictConfig) -> dict[str, Any]:
    """A `name` + keyword-arguments node (model, optim) as its keyword arguments, in plain values."""
    plain = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)  # `???`: the user's to give
    return {key: value for key, value in plain.items() if key != "name"}


def _check_compiled_layer_sampling(cfg: DictConfig) -> None:
    """An optimizer that switches layers' gradients on and off each step (JointSpar) runs compiled only where each
    compiled graph sees a few such switches: the model compiled by regions, the optimizer sampling whole blocks
    (its `granularity`). Each region then compiles once per pattern of its blocks (a BERT layer: on or off, its
    input needing a gradient or not). A whole-model graph, or one that sees every tensor switch on its own, would
    be compiled again for most new draws."""
    whole = not compiles_by_regions(cfg.model.name)
    if whole or OmegaConf.select(cfg, "optim.granularity") == "tensor":
        why = (f"model.name={cfg.model.name} is compiled as a whole" if whole
               else "optim.granularity=tensor switches every tensor on its own")
        raise ConfigError(f"trainer.compile=true with optim={cfg.optim.name}, which changes every step which "
                          f"layers compute gradients, and {why}: a compiled graph would be rebuilt for most new "
                          "draws. Set trainer.compile=false")


def _check_across_groups(cfg: DictConfig) -> None:
    """What no single group can check: the data's class count must be the model head's, its sequences must fit
    the model's position embeddings, a gradient all-reduce dtype needs an optimizer that uses DDP, and an
    optimizer that samples layers compiles only by regions."""
    data_classes, model_classes = OmegaConf.select(cfg, "data.num_classes"), OmegaConf.select(cfg, "model.num_classes")
    if data_classes is not None and model_classes is not None and data_classes != model_classes:
        raise ConfigError(f"data.num_classes={data_classes} differs from model.num_classes={model_classes}")
    wire, spec = cfg.trainer.grad_allreduce_dtype, get_optimizer_spec(cfg.optim.name)
    if spec.samples_layers and cfg.trainer.compile:
        _check_compiled_layer_sampling(cfg)
    if wire != "fp32" and spec.grad_sync != "ddp":
        raise ConfigError(f"trainer.grad_allreduce_dtype={wire} sets DDP's gradient all-reduce, which "
                          f"optim={cfg.optim.name} does not use (it communicates by itself; see its own options)")
    seq_len = OmegaConf.select(cfg, "data.max_seq_len")
    positions = OmegaConf.select(cfg, "model.max_position_embeddings")
    if seq_len is not None and positions is not None and seq_len > positions:
        raise ConfigError(f"data.max_seq_len={seq_len} exceeds model.max_position_embeddings={positions}: shorten "
                          "the sequences or give the model more positions")


def validate(cfg: DictConfig) -> Checked:
    """Fail fast, before workers start, on values that cannot work; return what the checks derived.

    Every error is a `ConfigError` whose one-line message names the key as the user writes it.
    """
    try:
        return _validate(cfg)
    except MissingMandatoryValue as err:  # `???` in a recipe: a value only the user can give (a dataset path)
        raise ConfigError(f"{err.full_key} is not set: give {err.full_key}=... on the command line (or in "
                          "conf/local/default.yaml)") from None


def _validate(cfg: DictConfig) -> Checked:
    refuse_unknown_keys(cfg)
    check_run_name(cfg.name)
    with options_of("trainer"):
        check_trainer_config(cfg.trainer)
    with options_of("precision"):
        check_precision_config(cfg.precision)
    check_task_config(cfg.task.name)
    model_options = _options(cfg.model)
    check_model_config(cfg.model.get("name"), model_options)
    optimizer_options = check_optimizer_config(cfg.optim.get("name"), _options(cfg.optim))
    check_schedule_config(cfg.schedule.name, cfg.schedule.kwargs, total_steps=cfg.trainer.max_steps or 1)
    geometry = batch_geometry(cfg.trainer, launch_world_size(cfg))
    check_data(cfg.data, geometry.micro_batch_size)
    _check_across_groups(cfg)
    return Checked(geometry, model_options, optimizer_options)
