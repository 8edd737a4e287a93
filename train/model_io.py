"""Building the configured model, starting it from earlier weights, and exporting it for transformers."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from core.atomic import atomic_write_json, replace_directory
from core.errors import ConfigError
from models import create_model, export_names, init_refusal, init_summary, pretrained_state, quiet_transformers
from optim import get_optimizer_spec
from train.checkpoint import init_checkpoint, model_state, read_meta
from train.run_dir import RunDir

EXPORT_MARKER = "export.json"  # written into every export: what tells an export of this project from other folders


def is_export(directory: Path) -> bool:
    """Whether `directory` is an export this project wrote (`export_pretrained`), which a new export may replace."""
    return (Path(directory) / EXPORT_MARKER).is_file()


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


def export_pretrained(
    model: nn.Module, tokenizer: Any, directory: Path, *, data_config: Mapping[str, Any] | None = None,
    label_names: Sequence[str] | None = None, source: Path | None = None,
) -> Path:
    """`save_pretrained` model and tokenizer into `directory`, replacing it only once fully written.

    The export is built under a unique staging name beside `directory` (`tempfile.mkdtemp`: nothing of the user's
    is in its way) and swapped in by `replace_directory`. It carries `export.json` (`EXPORT_MARKER`), naming the
    checkpoint it came from (`source`), by which `train.export` knows a directory it may replace.

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
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
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
