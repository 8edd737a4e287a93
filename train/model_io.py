"""Building the configured model, starting it from earlier weights, and exporting it for transformers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from data.atomic import replace_directory
from models import create_model
from train.checkpoint import model_state


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
    state = model_state(path)
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
    replace_directory(staging, directory)
    return directory
