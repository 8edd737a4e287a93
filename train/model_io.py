"""Building the configured model, starting it from earlier weights, and exporting it for transformers."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from models import create_model


def build_model(model_cfg: DictConfig, init_from: str | None, tokenizer: Any) -> nn.Module:
    """Create the model, check it can embed every token id the tokenizer produces, and load `init_from`."""
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    model = create_model(kwargs.pop("name"), **kwargs)
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

    Heads the source lacks (a QA head on pretraining weights) start fresh; a module the source has only
    in part is an error, since that means the architectures differ.
    """
    state = _checkpoint_state(path)
    if state is None:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"trainer.init_from={path}: expected a run directory (checkpoints/), a checkpoint directory "
                "(shared.pt) or a save_pretrained directory (config.json)"
            )
        if hasattr(type(model), "from_pretrained"):
            # transformers maps base-model prefixes (a saved BertModel into BertForQuestionAnswering) for us.
            state = type(model).from_pretrained(path, config=model.config).state_dict()
        else:  # a timm export (models.export_timm_model)
            from safetensors.torch import load_file

            state = load_file(str(path / "model.safetensors"))
    missing, _ = model.load_state_dict(state, strict=False)
    loaded_modules = {key.split(".")[0] for key in state if key in model.state_dict()}
    if not loaded_modules:
        raise ValueError(f"trainer.init_from={path}: none of its weights match the model's parameter names")
    partial = [key for key in missing if key.split(".")[0] in loaded_modules]
    if partial:
        raise ValueError(
            f"trainer.init_from={path} does not fit the model: it lacks {partial[0]} ({len(partial)} keys missing)"
        )


def _checkpoint_state(path: Path) -> dict[str, torch.Tensor] | None:
    """The model state of a run directory's newest checkpoint or of a checkpoint directory, else None."""
    if (path / "checkpoints").is_dir():
        steps = sorted(p for p in (path / "checkpoints").iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
        if not steps:
            raise FileNotFoundError(f"trainer.init_from={path} is a run directory without checkpoints")
        path = steps[-1]
    if not (path / "shared.pt").is_file():
        return None
    state = torch.load(path / "shared.pt", map_location="cpu", weights_only=False)
    if "model" not in state:  # self-synchronising optimizers keep the model with each rank
        state = torch.load(path / "rank_00000.pt", map_location="cpu", weights_only=False)
    return state["model"]


def export_pretrained(model: nn.Module, tokenizer: Any, directory: Path) -> Path:
    """`save_pretrained` model and tokenizer into `directory`, replacing it only once fully written."""
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(staging)
    else:  # a timm model: model.safetensors + timm's config.json (timm.create_model("local-dir:<dir>"))
        from models import export_timm_model

        export_timm_model(model, staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(staging, directory)
    return directory
