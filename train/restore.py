"""Rebuilding trained weights from what a command names (a run, one of its checkpoints, its best kept one, or an
export) with the model and data they were trained with: what `train.export` and `train.evaluate` share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from core.errors import ConfigError, UserError, config_error
from core.options import apply_overrides
from data import DataRequest, TaskData, build_data
from train.checkpoint import SHARED_FILE, best_checkpoint, complete_checkpoints
from train.config import register_configs, validate
from train.distributed import pick_device
from train.model_init import build_model
from train.run_dir import RunDir

EXPORT_CONFIG = "config.json"  # what save_pretrained and timm's save_for_hf both write


@dataclass(frozen=True)
class Weights:
    """A checkpoint or export directory, and the run that wrote it (None: an export outside any run)."""

    path: Path
    run_dir: RunDir | None

    @property
    def is_checkpoint(self) -> bool:
        return (self.path / SHARED_FILE).is_file()


def find_weights(path: str | Path, *, best: bool = False) -> Weights:
    """The weights `path` names: a run directory's newest checkpoint (`best`: the best one `best.json` keeps), a
    checkpoint directory, or an export directory. Anything else is a `UserError` saying what was expected."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    run_dir = RunDir(path)
    if run_dir.checkpoints_dir.is_dir():
        if best:
            checkpoint = best_checkpoint(run_dir.checkpoints_dir)
            if checkpoint is None or not checkpoint.is_dir():
                raise UserError(f"{path} keeps no best checkpoint (checkpoints/best.json): its run needs "
                                "trainer.keep_best > 0 and an evaluation; leave out --best for the newest checkpoint")
        else:
            found = complete_checkpoints(run_dir.checkpoints_dir)
            if not found:
                raise UserError(f"{path} is a run directory without a complete checkpoint")
            checkpoint = found[-1]
        return Weights(checkpoint, run_dir)
    if best:
        raise UserError(f"--best picks among a run's kept checkpoints: give the run directory, not {path}")
    if (path / SHARED_FILE).is_file():  # <run>/checkpoints/step_N
        return Weights(path, _recorded_run(path.parent.parent))
    if (path / EXPORT_CONFIG).is_file():  # <run>/hf_model, or an export copied anywhere
        return Weights(path, _recorded_run(path.parent))
    raise UserError(f"{path} is neither a run directory (checkpoints/), a checkpoint directory ({SHARED_FILE}) nor "
                    f"an export ({EXPORT_CONFIG})")


def _recorded_run(path: Path) -> RunDir | None:
    run_dir = RunDir(path)
    return run_dir if run_dir.config_file.is_file() else None


def weights_config(weights: Weights, overrides: list[str]) -> DictConfig:
    """The config the weights were trained with (their run's recorded one) with `overrides` (key=value) applied; for
    weights no run recorded, the config `python -m train <overrides>` composes (`experiment=...`, say)."""
    if weights.run_dir is not None:
        cfg = recorded_config_with_new_keys(weights.run_dir)
        apply_overrides(cfg, overrides, owner=f"the config {weights.run_dir.path} recorded")
        return cfg
    return _compose(overrides)


def recorded_config_with_new_keys(run_dir: RunDir) -> DictConfig:
    """The run's recorded config, completed with the keys the project added since it was recorded, at their defaults
    for the run's choices (composed from its recorded group choices and command line), so a run of an earlier
    version still exports and evaluates. Every recorded value stands; the record alone where it recorded no command
    line (a run started from Python) or where its choices no longer compose."""
    recorded = run_dir.recorded_config()
    command_line = [f"{group}={choice}" for group, choice in run_dir.recorded_choices().items()]
    command_line += run_dir.recorded_overrides()
    if not command_line:
        return recorded
    try:
        today = _compose(command_line)
    except ConfigError:
        return recorded
    return OmegaConf.merge(OmegaConf.create(OmegaConf.to_container(today)), recorded)


def _compose(overrides: list[str]) -> DictConfig:
    """The config `python -m train <overrides>` runs with."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException

    register_configs()
    try:
        with initialize_config_module("conf", version_base="1.3"):
            return compose("config", overrides=overrides)
    except HydraException as err:
        raise config_error(err) from None


def rebuild(cfg: DictConfig, weights: Path, device: str) -> tuple[nn.Module, TaskData, torch.device]:
    """The model of `cfg` with `weights` loaded on `device`, and the run's data as one process sees it."""
    with open_dict(cfg):
        cfg.trainer.nproc_per_node = 1  # one process reads the data: no batch split across ranks to plan for
    checked = validate(cfg)
    data = build_data(cfg.data, DataRequest(rank=0, world_size=1, micro_batch_size=checked.geometry.micro_batch_size,
                                            seed=cfg.trainer.seed))
    target = pick_device(device)
    model = build_model(cfg.model.name, checked.model_options, str(weights), data.tokenizer).to(target)
    return model, data, target
