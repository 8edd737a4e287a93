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
    """Create the model and check it can embed every token id the tokenizer produces."""
    kwargs = OmegaConf.to_container(model_cfg, resolve=True)
    model = create_model(kwargs.pop("name"), **kwargs)
    embedding_rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedding_rows:
        raise ValueError(
            f"the vocabulary has {len(tokenizer)} tokens but model.vocab_size gives only {embedding_rows} "
            "embedding rows: set model.vocab_size to the vocabulary size"
        )
    if init_from:
        model.load_state_dict(load_weights(Path(init_from)))
    return model


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Model weights from a `save_pretrained` directory, one of our checkpoints, or a run directory."""
    if (path / "checkpoints").is_dir():  # a run directory: its newest complete checkpoint
        steps = sorted(p for p in (path / "checkpoints").iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
        if not steps:
            raise FileNotFoundError(f"trainer.init_from={path} is a run directory without checkpoints")
        path = steps[-1]
    if (path / "shared.pt").is_file():
        state = torch.load(path / "shared.pt", map_location="cpu", weights_only=False)
        if "model" not in state:  # self-synchronising optimizers keep the model with each rank
            state = torch.load(path / "rank_00000.pt", map_location="cpu", weights_only=False)
        return state["model"]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path / name))
            return torch.load(path / name, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"trainer.init_from={path}: expected a save_pretrained directory (model.safetensors), "
        "a checkpoint directory (shared.pt) or a run directory (checkpoints/)"
    )


def export_pretrained(model: nn.Module, tokenizer: Any, directory: Path) -> Path:
    """`save_pretrained` model and tokenizer into `directory`, replacing it only once fully written."""
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(staging, directory)
    return directory
