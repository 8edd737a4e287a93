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


class ConfigError(ValueError):
    """A config value that cannot work; the message is one line naming the key."""


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
class PretrainingDataConfig:
    """Schema of the text-pretraining data options (conf/data/demo.yaml, ...)."""

    name: str = MISSING  # demo: the embedded pydoc corpus; shards: `python -m data.prepare` output (data.path)
    max_seq_len: int = MISSING  # tokens per sequence (128 in phase 1, 512 in phase 2)
    max_predictions: int = MISSING  # masked positions per sequence (20 / 80)
    masked_lm_prob: float = MISSING
    short_seq_prob: float = MISSING
    dupe_factor: int = MISSING  # passes over the corpus with different masks and pairings
    masking: str = MISSING  # static (fixed at preparation) or dynamic (redrawn per epoch)
    vocab_path: str | None = None  # null: the vendored bert-base-uncased vocab
    num_workers: int = 0  # loader worker processes per rank
    # shards only: a prepared output_dir (the phase matching max_seq_len is picked) or one phase directory
    path: str | None = None


@dataclass
class SquadDataConfig:
    """Schema of the question-answering data options (conf/data/squad*.yaml)."""

    name: str = MISSING  # squad
    train_file: str | None = MISSING  # SQuAD v1.1 JSON; null with hf_dataset set
    dev_file: str | None = MISSING
    hf_dataset: str | None = None  # e.g. "squad": load train/validation with `datasets` (needs the network)
    vocab_path: str | None = None  # a vocab.txt or a tokenizer directory; null: the vendored vocab
    max_seq_len: int = MISSING  # 384
    doc_stride: int = MISSING  # 128
    max_query_len: int = MISSING  # 64
    n_best_size: int = MISSING  # 20
    max_answer_len: int = MISSING  # 30
    eval_batch_size: int = 32
    num_workers: int = 0


@dataclass
class ImageDataConfig:
    """Schema of the image-classification data options (conf/data/imagenet.yaml, digits.yaml)."""

    name: str = MISSING  # images: data.format under data.path; digits: scikit-learn's digits written to data.path
    format: str = MISSING  # folder (<path>/<split>/<class>/<image>) | tar (WebDataset shards) | hf (datasets)
    path: str | None = MISSING  # the dataset root (hf: a save_to_disk directory or a hub name)
    train_split: str = MISSING
    eval_split: str | None = MISSING  # null: no held-out evaluation
    image_key: str = "image"  # hf columns
    label_key: str = "label"
    num_classes: int | None = MISSING  # the model head's classes, checked against the data (null: unchecked)
    img_size: int = MISSING
    scale: list[float] = MISSING  # RandomResizedCrop area range
    ratio: list[float] = MISSING  # RandomResizedCrop aspect-ratio range
    hflip: float = MISSING
    auto_augment: str | None = MISSING  # timm RandAugment spec, e.g. rand-m9-mstd0.5-inc1
    color_jitter: float = MISSING
    interpolation: str = MISSING
    re_prob: float = MISSING  # random erasing
    re_mode: str = MISSING
    re_count: int = MISSING
    mean: list[float] = MISSING
    std: list[float] = MISSING
    crop_pct: float = MISSING  # eval: resize floor(img_size / crop_pct), centre crop img_size
    mixup_alpha: float = MISSING
    cutmix_alpha: float = MISSING
    mixup_prob: float = MISSING
    mixup_switch_prob: float = MISSING
    mixup_mode: str = MISSING
    label_smoothing: float = MISSING
    eval_batch_size: int = MISSING
    num_workers: int = 0  # loader worker processes per rank


@dataclass
class ScheduleConfig:
    name: str = MISSING  # poly_warmup | linear_warmup_cosine | constant
    kwargs: dict[str, Any] = field(default_factory=dict)  # the schedule's own arguments


@dataclass
class PrecisionConfig:
    dtype: Precision = Precision.fp32  # autocast dtype; fp16 adds a GradScaler
    init_scale: float = 65536.0  # fp16 loss scale at the start (NVIDIA BERT: 2^20)
    growth_interval: int = 2000  # fp16 steps without overflow before the scale doubles


@dataclass
class TrainerConfig:
    seed: int = 42
    max_steps: int | None = None  # optimizer steps of the whole run (or set epochs)
    epochs: float | None = None  # passes over the training set; max_steps is derived from it
    global_batch_size: int = MISSING  # sequences per optimizer step over all ranks: the source of truth
    micro_batch_size: int = MISSING  # sequences per forward pass on one rank; accumulation is derived
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    device: str = "auto"  # auto | cpu | cuda
    nproc_per_node: int = 1  # >1: start that many local workers (torch elastic); under torchrun/srun: 1
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | gloo | nccl
    log_every: int = 10  # optimizer steps between metric records
    eval_every: int = 0  # optimizer steps between evaluations (tasks that have one); 0: only at the end
    checkpoint_every: int = 200  # optimizer steps between checkpoints; 0 keeps only the final one
    keep_last: int = 3  # checkpoints kept
    resume: bool = True  # continue from the run directory's newest checkpoint
    steps_this_run: int | None = None  # stop (with a checkpoint) after this many steps, for time-boxed jobs
    init_from: str | None = None  # weights to start from (a checkpoint dir or a save_pretrained dir)
    compile: bool = False  # torch.compile the model
    ema_decay: float | None = None  # keep an EMA of the weights with this decay (evaluated too; null: off)
    best_metric: str | None = None  # keep the checkpoints with the best values of this eval metric (eval/top1)
    best_metric_mode: str = "max"  # max | min: which end of best_metric is best
    keep_best: int = 0  # best checkpoints kept besides the last keep_last (needs best_metric)


@dataclass
class LoggerConfig:
    progress_bar: bool = True
    tensorboard: bool = True
    wandb: WandbMode = WandbMode.disabled
    wandb_project: str = "slamb-trainer"


@dataclass
class Config:
    name: str = MISSING  # run name: the run directory is runs/<name> unless hydra.run.dir says otherwise
    task: TaskConfig = field(default_factory=TaskConfig)
    model: dict[str, Any] = field(default_factory=dict)  # `name` + the builder's keyword arguments
    data: Any = MISSING  # typed by the chosen option's schema (e.g. data/pretraining_schema)
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
    store.store(group="data", name="pretraining_schema", node=PretrainingDataConfig)
    store.store(group="data", name="images_schema", node=ImageDataConfig)
    store.store(group="data", name="squad_schema", node=SquadDataConfig)


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


def _in_range(cfg: DictConfig, key: str, low: float, high: float) -> None:
    value = OmegaConf.select(cfg, key)
    if not low <= value <= high:
        raise ConfigError(f"{key}={value} must be in [{low}, {high}]")


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


def _check_pretraining_data(cfg: DictConfig) -> None:
    _positive(cfg, "data.max_seq_len", "data.max_predictions", "data.dupe_factor")
    if cfg.data.masking not in ("static", "dynamic"):
        raise ConfigError(f"data.masking={cfg.data.masking} must be one of static, dynamic")
    _in_range(cfg, "data.masked_lm_prob", 0.0, 1.0)
    _in_range(cfg, "data.short_seq_prob", 0.0, 1.0)
    if cfg.data.max_predictions >= cfg.data.max_seq_len:
        raise ConfigError(
            f"data.max_predictions={cfg.data.max_predictions} must be below data.max_seq_len={cfg.data.max_seq_len}"
        )
    if cfg.data.name == "shards" and not cfg.data.path:
        raise ConfigError("data.path=None must name a prepared directory (python -m data.prepare output_dir=...)")


def _check_image_data(cfg: DictConfig) -> None:
    data = cfg.data
    for key, allowed in (("format", ("folder", "tar", "hf")), ("mixup_mode", ("batch", "pair", "elem")),
                         ("re_mode", ("const", "rand", "pixel"))):
        if data[key] not in allowed:
            raise ConfigError(f"data.{key}={data[key]} must be one of {', '.join(allowed)}")
    if data.name != "digits" and not data.path:
        raise ConfigError(f"data.path={data.path} must name the dataset root (data.format={data.format})")
    _positive(cfg, "data.img_size", "data.eval_batch_size")
    for key in ("hflip", "re_prob", "mixup_prob", "mixup_switch_prob"):
        _in_range(cfg, f"data.{key}", 0.0, 1.0)
    _in_range(cfg, "data.label_smoothing", 0.0, 0.999)
    if not 0.0 < data.crop_pct <= 1.0:
        raise ConfigError(f"data.crop_pct={data.crop_pct} must be in (0, 1]")
    mixing = (data.mixup_alpha > 0 or data.cutmix_alpha > 0) and data.mixup_prob > 0
    if mixing and cfg.trainer.micro_batch_size % 2:
        raise ConfigError(
            f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} must be even with mixup/cutmix on "
            "(timm mixes each batch with its reverse); or set data.mixup_alpha=0 data.cutmix_alpha=0"
        )
    model_classes = OmegaConf.select(cfg, "model.num_classes")
    if data.num_classes is not None and model_classes is not None and data.num_classes != model_classes:
        raise ConfigError(f"data.num_classes={data.num_classes} differs from model.num_classes={model_classes}")


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
    if "max_predictions" in cfg.data:
        _check_pretraining_data(cfg)
    if "mixup_alpha" in cfg.data:
        _check_image_data(cfg)
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
