"""Building the configured model and starting it from earlier weights (`trainer.init_from`): a run, one of its
checkpoints or a `save_pretrained` export."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from core.errors import ConfigError
from models import create_model, export_names, init_refusal, init_summary, pretrained_state
from optim import get_optimizer_spec
from train.checkpoint import init_checkpoint, model_state, read_meta
from train.run_dir import RunDir


def build_model(name: str, options: Mapping[str, Any], init_from: str | None, tokenizer: Any) -> nn.Module:
    """Create model `name`, check it can embed every token id the tokenizer produces, and load `init_from`."""
    model = create_model(name, **options)
    if tokenizer is not None:
        embedding_rows = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > embedding_rows:
            raise ValueError(
                f"the vocabulary has {len(tokenizer)} tokens but model.vocab_size gives only {embedding_rows} "
                "embedding rows: set model.vocab_size to the vocabulary size"
            )
    if init_from:
        load_weights(model, Path(init_from))
    return model


def load_weights(model: nn.Module, path: Path) -> None:
    """Start `model` from a run directory, one of our checkpoints, or a `save_pretrained` directory.

    Heads the source lacks (a QA head on pretraining weights) start fresh; weights that do not fit are refused
    (`check_init_weights`).
    """
    state = init_weights(model, path)
    check_init_weights(model, state, path)
    model.load_state_dict(state, strict=False)


def check_init_from(name: str, options: Mapping[str, Any], init_from: str) -> str | None:
    """`trainer.init_from`'s weights checked against the model built on the meta device (no memory, no compute),
    so the launching process refuses weights of another model before it records the run or starts a worker, and
    the line that says what loads and what starts fresh, for the run's log.

    A transformers export is left to `from_pretrained`, which maps its names as it loads (its shape was checked
    against its config.json); its line comes from its tensors' names (None: none can be read).
    """
    import torch

    path = Path(init_from)
    checkpoint = init_checkpoint(path)
    recorded = RunDir(checkpoint.parent.parent).recorded_config() if checkpoint is not None else None
    refusal = init_refusal(name, options, path, recorded.model.name if recorded is not None else None)
    if refusal is not None:
        raise ConfigError(f"trainer.init_from={path} {refusal}")
    with torch.device("meta"):
        model = create_model(name, **options)
    state = model_state(path)
    if state is None and (path / "config.json").is_file() and hasattr(type(model), "from_pretrained"):
        given = export_names(model, path)
        return None if given is None else f"trainer.init_from={path}: {init_summary(model.state_dict(), given)}"
    state = init_weights(model, path) if state is None else state
    check_init_weights(model, state, path)
    return f"trainer.init_from={path}: {init_summary(model.state_dict(), state)}"


def init_weights(model: nn.Module, path: Path) -> Mapping[str, Any]:
    """The weights `trainer.init_from=path` gives `model`, under the model's parameter names."""
    state = model_state(path)
    if state is not None:
        return state
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"trainer.init_from={path}: expected a run directory (checkpoints/), a checkpoint directory "
            "(shared.pt) or a save_pretrained directory (config.json)"
        )
    if hasattr(type(model), "from_pretrained"):
        # transformers maps base-model prefixes (a saved BertModel into BertForQuestionAnswering) for us.
        return pretrained_state(model, path)
    from safetensors.torch import load_file  # a timm export (models.export_timm_model)

    return load_file(str(path / "model.safetensors"))


def check_init_weights(model: nn.Module, state: Mapping[str, Any], path: Path) -> None:
    """Refuse, in one line, weights of another model: none of their names match, a shape differs, or a module
    they have is only partly there (the architectures differ)."""
    own = model.state_dict()
    matching = [key for key in state if key in own]
    if not matching:
        raise ConfigError(f"trainer.init_from={path}: none of its weights match the model's parameter names (a "
                          "run of another model?)")
    for key in matching:
        if tuple(state[key].shape) != tuple(own[key].shape):
            raise ConfigError(f"trainer.init_from={path} does not fit the model: {key} has shape "
                              f"{tuple(state[key].shape)} there and {tuple(own[key].shape)} here")
    loaded_modules = {key.split(".")[0] for key in matching}
    partial = [key for key in own if key not in state and key.split(".")[0] in loaded_modules]
    if partial:
        raise ConfigError(f"trainer.init_from={path} does not fit the model: it lacks {partial[0]} ({len(partial)} "
                          "keys missing)")


def optimizer_checkpoint(init_from: str | None, optimizer: str, world_size: int) -> Path:
    """The checkpoint whose optimizer state `trainer.init_optimizer_state=true` continues: the one `init_from`'s
    weights come from. Refused in one line (`ConfigError`) unless it was written with the same optimizer
    `optimizer`, one that can continue its state (`OptimSpec.restart_refusal`), and, when that state is per rank, by
    `world_size` ranks. Called once, by the launching process (`train.plan`)."""
    key = "trainer.init_optimizer_state=true"
    reason = get_optimizer_spec(optimizer).restart_refusal
    if reason is not None:
        raise ConfigError(f"{key}: optim={optimizer} {reason}: set trainer.init_optimizer_state=false")
    if not init_from:
        raise ConfigError(f"{key} needs trainer.init_from=<run directory or checkpoint directory> of a run with "
                          f"optim={optimizer}, whose optimizer state is loaded with its weights")
    checkpoint = init_checkpoint(Path(init_from))
    if checkpoint is None:
        raise ConfigError(f"{key}: trainer.init_from={init_from} is not a run or checkpoint directory (an export "
                          "holds weights only): give the directory of the run that wrote it, or set "
                          "trainer.init_optimizer_state=false to load only its weights")
    meta = read_meta(checkpoint)
    written_with = meta["optimizer"]
    if written_with != optimizer:
        raise ConfigError(f"{key}: checkpoint {checkpoint} was written with optim={written_with}, this run has "
                          f"optim={optimizer}: use that optimizer, or set trainer.init_optimizer_state=false to "
                          "load only the weights")
    written_by = meta["world_size"]
    if written_by != world_size and meta["rank_bound"]:  # see train.checkpoint.check_world_size
        raise ConfigError(f"{key}: checkpoint {checkpoint} holds optimizer state bound to the {written_by} ranks "
                          f"that wrote it and this run has {world_size}: run with {written_by} ranks, or set "
                          "trainer.init_optimizer_state=false to load only the weights")
    return checkpoint
