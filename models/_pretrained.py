"""Starting a model from a transformers export: loaded quietly, and named beforehand by the export's tensor names alone
(its safetensors headers), so the launching process can say what loads and what starts fresh.

transformers' own account (a "Loading weights" progress bar and a LOAD REPORT table with terminal colour codes, even
into a pipe or a batch log) is silenced; `init_summary` says what matters of it in one line.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
from torch import nn

from core.errors import ConfigError
from models._registry import export_holds

_INDEX = "model.safetensors.index.json"  # a sharded export's map of tensor names to files
_SINGLE = "model.safetensors"
_LEGACY = re.compile(r"(?<=LayerNorm\.)(gamma|beta)$")  # the names of BERT's first checkpoints
_RENAMED = {"gamma": "weight", "beta": "bias"}


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at the error level and its progress bars off, both restored afterwards."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def pretrained_state(model: nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The weights a transformers export gives `model`, by `from_pretrained` (which maps base-model prefixes and
    older tensor names), without its bar and report. Tensors the export lacks come back freshly initialised; an
    export none of whose tensors fit, or one with a tensor of another shape, is refused in one line."""
    with quiet_transformers():
        loaded, info = type(model).from_pretrained(directory, config=model.config, ignore_mismatched_sizes=True,
                                                   output_loading_info=True)
    state = loaded.state_dict()
    if info["mismatched_keys"]:
        key, theirs, ours = min(info["mismatched_keys"])
        raise ConfigError(f"{directory} does not fit the model: {key} has shape {tuple(theirs)} there and "
                          f"{tuple(ours)} here")
    if len(info["missing_keys"]) == len(state):
        raise ConfigError(f"{directory} holds {export_holds(directory)[1]}: none of its weights are the model's")
    return state


def export_names(model: nn.Module, directory: Path) -> set[str] | None:
    """The names `model` gives the tensors of the export in `directory`, read from its safetensors headers (no
    weights read), renamed as `from_pretrained` renames them for a BERT: the base model's prefix added to the
    weights of a base model (`embeddings.` -> `bert.embeddings.`) and LayerNorm's old `gamma`/`beta` names; with
    the names the model ties to them (BERT's MLM decoder is its word embeddings, saved once).

    None when there is no safetensors file (a .bin) or none of the names is the model's.
    """
    from safetensors import safe_open

    directory = Path(directory)
    if (directory / _INDEX).is_file():
        files = sorted(set(json.loads((directory / _INDEX).read_text())["weight_map"].values()))
    elif (directory / _SINGLE).is_file():
        files = [_SINGLE]
    else:
        return None
    names = set()
    for name in files:
        with safe_open(str(directory / name), framework="pt") as file:
            saved = file.keys()  # a list: the handle itself is no mapping
        names.update(_LEGACY.sub(lambda m: _RENAMED[m.group(1)], key) for key in saved)
    own = model.state_dict(keep_vars=True)
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    if not names & own.keys() and prefix != ".":
        names = {prefix + key for key in names}
    if not names & own.keys():
        return None
    loaded = {id(own[key]) for key in names if key in own}
    return names | {key for key, value in own.items() if id(value) in loaded}


def init_summary(own: Collection[str], given: Collection[str]) -> str:
    """What starting a model whose tensors are `own` from weights holding `given` does, in a few words: how many
    tensors load, and by module those that start fresh or go unused (a QA head on pretraining weights)."""
    loaded = sum(key in given for key in own)
    words = [f"all {loaded} tensors load" if loaded == len(own) else f"{loaded} of {len(own)} tensors load"]
    fresh = sorted(key for key in own if key not in given)
    unused = sorted(key for key in given if key not in own)
    if fresh:
        words.append(f"starting fresh: {_by_module(fresh)}")
    if unused:
        words.append(f"not used: {_by_module(unused)}")
    return "; ".join(words)


def _by_module(keys: Collection[str]) -> str:
    """`qa_outputs (2), cls.predictions (5)`: tensor names counted by their first two parts (their module)."""
    counts = Counter(".".join(key.split(".")[:-1][:2]) or key for key in keys)
    return ", ".join(f"{module} ({count})" for module, count in counts.items())
