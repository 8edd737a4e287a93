"""The run-directory check of planning: a run continues the checkpoints its directory holds only with
trainer.resume, the optimizer, seed and model they were trained with, and a world size they can be loaded on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from models import model_options_in_use
from train.checkpoint import RunDirectoryError, check_world_size, newest_checkpoint_meta
from train.run_dir import RunDir

if TYPE_CHECKING:
    from train.plan import RunPlan


def check_run_directory(plan: RunPlan) -> None:
    """Refuse, in one line, a run whose directory holds checkpoints it must not or cannot continue."""
    run_dir = plan.run_dir
    newest = newest_checkpoint_meta(RunDir(run_dir).checkpoints_dir)
    if newest is None:
        return
    checkpoint, meta = newest
    if not plan.trainer.resume:
        raise RunDirectoryError(
            f"{run_dir} already has checkpoint {checkpoint} and trainer.resume=false: pick another name=... or "
            "remove the directory"
        )
    trained_with, wanted = meta["optimizer"], plan.optimizer.name
    if trained_with != wanted:
        raise RunDirectoryError(
            f"optim.name={wanted}: {run_dir} was trained with optim={trained_with} (checkpoint "
            f"{checkpoint.name}); resume with optim={trained_with}, or start a new run (another name=...) with "
            f"trainer.init_from={run_dir} to keep only the weights"
        )
    check_world_size(checkpoint, meta, plan.geometry.world_size)
    recorded = RunDir(run_dir).recorded_config()  # it describes the checkpoints: only accepted runs rewrite it
    if recorded is not None:
        _check_same_seed(plan, checkpoint, recorded)
        _check_same_packing(plan, checkpoint, recorded)
        _check_same_model(plan, checkpoint, recorded)


def _check_same_seed(plan: RunPlan, checkpoint: Path, recorded: DictConfig) -> None:
    """Refuse to continue checkpoints with another seed: the data order they are part-way through is the seed's."""
    seed, wanted = OmegaConf.select(recorded, "trainer.seed"), plan.trainer.seed
    if seed is not None and seed != wanted:
        raise RunDirectoryError(
            f"trainer.seed={wanted}: {plan.run_dir} was trained with trainer.seed={seed} (checkpoint "
            f"{checkpoint.name}), whose data order it is part-way through; resume with trainer.seed={seed}, or start "
            f"a new run (another name=...) with trainer.init_from={plan.run_dir} to keep only the weights"
        )


def _check_same_packing(plan: RunPlan, checkpoint: Path, recorded: DictConfig) -> None:
    """Refuse to continue checkpoints with another data.pack_sequences (unset: 1, no packing): their data position
    counts rows of the packing they were trained with."""
    packed = OmegaConf.select(recorded, "data.pack_sequences", default=1)
    wanted = getattr(plan.data, "pack_sequences", 1)  # 1 for the data kinds that do not pack
    if packed != wanted:
        raise RunDirectoryError(
            f"data.pack_sequences={wanted}: {plan.run_dir} was trained with data.pack_sequences={packed} (checkpoint "
            f"{checkpoint.name}), whose rows its data position counts; resume with data.pack_sequences={packed}, or "
            f"start a new run (another name=...) with trainer.init_from={plan.run_dir} to keep only the weights"
        )


def _check_same_model(plan: RunPlan, checkpoint: Path, recorded_config: DictConfig) -> None:
    """Refuse to continue checkpoints of another model (the recorded config's): their tensors would not load."""
    recorded = _model_in_use(OmegaConf.to_container(recorded_config.get("model", {}), resolve=True))
    wanted = _model_in_use({"name": plan.model.name, **plan.model.options})
    differing = sorted(k for k in recorded.keys() | wanted.keys() if recorded.get(k) != wanted.get(k))
    if differing:
        key = differing[0]
        raise RunDirectoryError(
            f"model.{key}={wanted.get(key)}: {plan.run_dir} holds checkpoints of a model with model.{key}="
            f"{recorded.get(key)} ({checkpoint.name}); resume with that model, or pick another name=... (another run "
            "directory) for this one"
        )


def _model_in_use(model: dict[str, Any]) -> dict[str, Any]:
    """A model group's values with each null as the builder fills it, so a refusal names the value in use."""
    if "name" not in model:
        return model
    options = {key: value for key, value in model.items() if key != "name"}
    return {"name": model["name"], **model_options_in_use(model["name"], options)}
