"""`RunDir`: the layout of a run directory, the one place that names the files a run writes.

    runs/<name>/
    ├── .hydra/
    │   ├── config.yaml          the accepted config, resolved (only an accepted run rewrites it)
    │   ├── overrides.yaml       its command-line overrides
    │   └── choices.yaml         the option picked in each config group (model: bert_large, optim: slamb, ...)
    ├── checkpoints/             step_00000200/ (meta.json, shared.pt, rank_00000.pt, ...) and best.json:
    │                            see train.checkpoint, which owns what is inside
    ├── metrics.jsonl            one record per logged step: train and eval/ metrics, time, elapsed
    ├── train.log                rank 0's info lines (start-up, one per training record, checkpoints, evaluations,
    │                            warnings), with times
    ├── tensorboard/             the same metrics for TensorBoard (logger.tensorboard=true)
    ├── wandb_id.txt             the run's wandb id, drawn at random on its first start (a resume reuses it)
    ├── predictions.json         SQuAD: the answer to every question of the latest evaluation
    ├── nbest_predictions.json   SQuAD: the n best answers to each
    ├── hf_model/                the final weights, save_pretrained (with the tokenizer; timm: model.safetensors)
    ├── hf_model_ema/            the final EMA weights (trainer.ema_decay set)
    ├── finished.json            the end-of-run evaluation and exports are done
    ├── summary.json             what the run did, for reports (train.summary)
    ├── eval.json                the metrics of `python -m train.evaluate` on this run's weights
    └── run.lock                 while a run is in it: its holder (host, pid, start time), locked (train.run_lock)

wandb keeps its own files in `wandb/` beside them when logger.wandb is not disabled.

`name=` is checked here too (`check_run_name`), before Hydra makes `runs/<name>` from it (`RunDirCallback`).

This module imports nothing heavy (no torch), so reporting tools that only read runs start quickly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.errors import ConfigError, user_errors_exit

_RECORDED_CONFIG_DIR = ".hydra"  # Hydra's name, so tools that know Hydra's outputs find the config
MAX_NAME_CHARACTERS = 200  # runs/<name>/<its files> stays well within the file systems' path limits
MAX_NAME_PART_BYTES = 255  # a file name's limit on common file systems (ext4, xfs, NFS)
_made_for_this_run: set[Path] = set()  # run directories Hydra made for a run started in this process


@dataclass(frozen=True)
class RunDir:
    """A run directory: every path in it, named by what it holds."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))  # a str from the command line or a worker's arguments

    def __str__(self) -> str:
        return str(self.path)

    @property
    def config_file(self) -> Path:
        return self.path / _RECORDED_CONFIG_DIR / "config.yaml"

    @property
    def overrides_file(self) -> Path:
        return self.path / _RECORDED_CONFIG_DIR / "overrides.yaml"

    @property
    def choices_file(self) -> Path:
        return self.path / _RECORDED_CONFIG_DIR / "choices.yaml"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def log_file(self) -> Path:
        return self.path / "train.log"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb_id_file(self) -> Path:
        return self.path / "wandb_id.txt"

    @property
    def predictions_file(self) -> Path:
        return self.path / "predictions.json"

    @property
    def nbest_predictions_file(self) -> Path:
        return self.path / "nbest_predictions.json"

    @property
    def export_dir(self) -> Path:
        return self.path / "hf_model"

    @property
    def ema_export_dir(self) -> Path:
        return self.path / "hf_model_ema"

    @property
    def finished_file(self) -> Path:
        return self.path / "finished.json"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def eval_file(self) -> Path:
        return self.path / "eval.json"

    @property
    def lock_file(self) -> Path:
        return self.path / "run.lock"

    def display_name(self) -> str:
        """What wandb and reports call the run: the directory's name, or for a multirun job (a numbered directory,
        whose number says nothing) its overrides."""
        overrides = self.recorded_overrides()
        return " ".join(overrides) if self.path.name.isdigit() and overrides else self.path.name

    def record_config(self, cfg: DictConfig, overrides: Sequence[str] | None,
                      choices: Mapping[str, str | None] | None = None) -> None:
        """Write the run's resolved config, its command-line overrides and its config group choices (Hydra's
        `runtime.choices`, less Hydra's own `hydra/` groups) beside its checkpoints, atomically: the resolved
        config alone does not say which preset a value came from."""
        from core.atomic import atomic_write_text  # here: the data package imports torch

        self.config_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_file, OmegaConf.to_yaml(cfg, resolve=True))
        if overrides is not None:
            atomic_write_text(self.overrides_file, OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
        if choices is not None:
            picked = {group: choice for group, choice in choices.items() if not group.startswith("hydra/")}
            atomic_write_text(self.choices_file, OmegaConf.to_yaml(OmegaConf.create(picked)))

    def recorded_config(self) -> DictConfig | None:
        """The config the run's checkpoints were trained with (None before any run was accepted here)."""
        return OmegaConf.load(self.config_file) if self.config_file.is_file() else None

    def recorded_overrides(self) -> list[str]:
        """The command-line overrides of the accepted run (none recorded: an empty list)."""
        return list(OmegaConf.load(self.overrides_file)) if self.overrides_file.is_file() else []

    def recorded_choices(self) -> dict[str, str]:
        """The config group choices of the accepted run (none recorded: an empty dict)."""
        if not self.choices_file.is_file():
            return {}
        return {group: choice for group, choice in OmegaConf.load(self.choices_file).items() if choice is not None}


def check_run_name(name: str) -> None:
    """Refuse a `name=` that names no directory of its own under runs/ ('' '.' '..' make runs/ itself or its parent
    the run, and an absolute path or a '..' leaves runs/), or one too long for the file system to hold."""
    shown = name if len(name) <= 60 else f"{name[:40]}...{name[-10:]}"
    parts = name.split("/")
    if name.startswith("/") or any(part.strip() in ("", ".", "..") for part in parts):
        raise ConfigError(f"name={shown!r} names no run directory of its own under runs/: give a name such as "
                          "name=my_run (parts split by / may not be empty, '.' or '..', and it may not start with /)")
    if len(name) > MAX_NAME_CHARACTERS:
        raise ConfigError(f"name={shown!r} is {len(name)} characters long: at most {MAX_NAME_CHARACTERS}, so that "
                          "the run's files stay within the file system's path limit")
    longest = max(parts, key=lambda part: len(part.encode()))
    if len(longest.encode()) > MAX_NAME_PART_BYTES:
        raise ConfigError(f"name={shown!r}: a directory name may have at most {MAX_NAME_PART_BYTES} bytes, and "
                          f"'{longest[:20]}...' has {len(longest.encode())}")


def is_new_run_directory(path: str | os.PathLike[str]) -> bool:
    """Whether the run directory is this run's own: not there yet, or made by Hydra for this run
    (`RunDirCallback`), so a refused run may remove it again."""
    path = Path(os.path.abspath(path))
    return not path.exists() or path in _made_for_this_run


def remove_if_empty(path: str | os.PathLike[str]) -> None:
    """Remove a run directory that holds nothing (a refused run's), leaving no empty runs/<name>/ behind."""
    with contextlib.suppress(OSError):  # not empty, or gone, or a mount point
        Path(path).rmdir()


class RunDirCallback(Callback):
    """Hydra's callback (conf/config.yaml): check `name=` before Hydra makes `runs/<name>` from it, and note whether
    that directory is new."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        with user_errors_exit():  # its line, exit code 2: Hydra turns a callback's exception into a warning
            check_run_name(config.name)
        try:
            run_dir = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
        except OmegaConfBaseException:  # it interpolates what only the job knows: it is not known to be new
            return
        if not run_dir.exists():
            _made_for_this_run.add(run_dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with user_errors_exit():
            check_run_name(config.name)
