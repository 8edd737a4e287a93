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
    _check_same(plan, checkpoint, "optim.name", meta["optimizer"], plan.optimizer.name, spelled="optim")
    check_world_size(checkpoint, meta, plan.geometry.world_size)
    recorded = RunDir(run_dir).recorded_config()  # it describes the checkpoints: only accepted runs rewrite it
    if recorded is not None:
        seed = OmegaConf.select(recorded, "trainer.seed")
        _check_same(plan, checkpoint, "trainer.seed", seed, plan.trainer.seed,
                    ", whose data order it is part-way through")
        packed = OmegaConf.select(recorded, "data.pack_sequences", default=1)  # unset in an older record: 1
        wanted = getattr(plan.data, "pack_sequences", 1)  # 1 for the data kinds that do not pack
        _check_same(plan, checkpoint, "data.pack_sequences", packed, wanted, ", whose rows its data position counts")
        _check_same_model(plan, checkpoint, recorded)


def _check_same(plan: RunPlan, checkpoint: Path, key: str, trained_with: Any, wanted: Any, why: str = "",
                spelled: str | None = None) -> None:
    """Refuse to continue checkpoints trained with another value of `key` (None: not recorded, nothing to compare),
    naming both and the way out; `spelled`: how the advice writes the key (the group's choice, say)."""
    if trained_with is None or trained_with == wanted:
        return
    spelled = spelled or key
    raise RunDirectoryError(
        f"{key}={wanted}: {plan.run_dir} was trained with {spelled}={trained_with} (checkpoint {checkpoint.name})"
        f"{why}; resume with {spelled}={trained_with}, or start a new run (another name=...) with "
        f"trainer.init_from={plan.run_dir} to keep only the weights"
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
