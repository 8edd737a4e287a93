"""Exporting a model for transformers or timm (`save_pretrained`), written whole or not at all, and marked as an
export of this project."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from core.atomic import atomic_write_json, replace_directory, staging_directory
from models import quiet_transformers

EXPORT_MARKER = "export.json"  # written into every export: what tells an export of this project from other folders


def is_export(directory: Path) -> bool:
    """Whether `directory` is an export this project wrote (`export_pretrained`), which a new export may replace."""
    return (Path(directory) / EXPORT_MARKER).is_file()


def export_pretrained(
    model: nn.Module, tokenizer: Any, directory: Path, *, data_config: Mapping[str, Any] | None = None,
    label_names: Sequence[str] | None = None, source: Path | None = None,
) -> Path:
    """`save_pretrained` model and tokenizer into `directory`, replacing it only once fully written.

    The export is built under a unique staging name beside `directory` (`core.atomic.staging_directory`, which also
    clears what a killed export left there) and swapped in by `replace_directory`. It carries `export.json`
    (`EXPORT_MARKER`), naming the checkpoint it came from (`source`), by which `train.export` knows a directory it
    may replace.

    transformers models: `config.architectures` names the stock transformers class (`BertForPreTraining`,
    `BertForQuestionAnswering`), never a project subclass. The tokenizer is saved with the weights, with its
    `vocab.txt` (WordPiece) and `model_max_length` = the model's `max_position_embeddings`.
    timm models: `model.safetensors` + timm's `config.json`, whose `pretrained_cfg` carries `data_config`
    (mean, std, crop_pct, interpolation, input_size: see `data.images.kinds.image_preprocessing` and
    `models.swin.timm_data_config`), and its `label_names` the data's class names.
    Every file gets mode 0o666 & ~umask (directories 0o777 & ~umask), as a plain `open()` would create it:
    0644 under the usual umask 022, so the weights are as readable as the config beside them.
    """
    is_transformers = hasattr(model, "save_pretrained")
    if (data_config is not None or label_names) and is_transformers:
        raise ValueError("data_config and label_names are for timm models (image preprocessing, class names); this "
                         "model is a transformers model")
    staging = staging_directory(directory)
    try:
        if is_transformers:
            with quiet_transformers():  # its "Writing model shards" bar would land in batch logs
                model.save_pretrained(staging)
            _name_stock_architecture(model, staging)
        else:  # a timm model: model.safetensors + timm's config.json (timm.create_model("local-dir:<dir>"))
            from models import export_timm_model

            export_timm_model(model, staging, data_config=data_config, label_names=label_names)
        if tokenizer is not None:
            max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
            save_tokenizer(tokenizer, staging, model_max_length=max_length)
        atomic_write_json(staging / EXPORT_MARKER, {"source": None if source is None else str(source)}, indent=1)
        make_readable(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_directory(staging, directory)
    return directory


def _name_stock_architecture(model: nn.Module, directory: Path) -> None:
    """Rewrite `config.architectures` to the nearest transformers class if `save_pretrained` wrote a subclass's."""
    import transformers

    stock = next(
        (cls.__name__ for cls in type(model).__mro__
         if cls.__module__.startswith("transformers.") and hasattr(transformers, cls.__name__)),
        None,
    )
    if stock is not None and model.config.architectures != [stock]:
        model.config.architectures = [stock]
        model.config.save_pretrained(directory)


def save_tokenizer(tokenizer: Any, directory: Path, model_max_length: int | None = None) -> None:
    """`tokenizer.save_pretrained(directory)` plus `vocab.txt`, with `model_max_length` set for the saved copy.

    A transformers 5 tokenizer built from a vocab file (data/text/tokenizer.py) writes only tokenizer.json and
    tokenizer_config.json; BERT users and tools expect `vocab.txt` too, which the WordPiece model writes.
    The tokenizer object itself is left unchanged.
    """
    saved_length = tokenizer.model_max_length
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.model_max_length = saved_length
    wordpiece = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if not (directory / "vocab.txt").exists() and type(wordpiece).__name__ == "WordPiece":
        wordpiece.save(str(directory))


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask alone must set it to read it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_readable(directory: Path) -> None:
    """Give every file under `directory` mode 0o666 & ~umask and every directory 0o777 & ~umask.

    Some writers (safetensors through a temporary file) create 0600 files whatever the umask; this gives
    them the mode a plain `open()` would have, as the config files beside them already have.
    """
    mask = _umask()
    for path in [directory, *directory.rglob("*")]:
        if path.is_symlink():
            continue
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
