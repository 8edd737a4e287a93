"""The data kinds (`data.name`): each one's typed schema, compose-time check and builder, looked up by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from core.options import check_non_negative, options_of
from core.registry import Registry


@dataclass(frozen=True)
class DataRequest:
    """What a run asks of its data, as plain values: who reads (rank of world size), how much, with which seed."""

    rank: int
    world_size: int
    micro_batch_size: int
    seed: int
    pin_memory: bool = False  # pin batches for faster host-to-GPU copies (on when training on CUDA)


@dataclass
class TaskData:
    """What a run gets from its data: the training stream, the held-out data and the tokenizer."""

    train: Any  # endless, resumable micro-batches: state_dict(), load_state_dict(), samples_per_epoch, close()
    eval: Any | None = None  # held-out data for the task's evaluate(), on every rank (each evaluates a share)
    tokenizer: Any | None = None  # exported beside text models
    source: str = ""  # what the run trains on, in words, for its start-up lines
    preprocessing: dict[str, Any] | None = None  # image mean/std, crop and size, carried by the model's export
    class_names: list[str] | None = None  # the image labels' names in label order, carried by the model's export


@dataclass(frozen=True)
class DataKind:
    """One `data.name`: its config schema (a dataclass), its value check and its builder."""

    name: str
    schema: type
    check: Callable[[DictConfig, int], None]  # (data config, micro-batch size); raises ConfigError naming data.<key>
    build: Callable[[DictConfig, DataRequest, bool], TaskData | None]  # dry=True: check the files, return None


# Filled by the `kinds` module of each package of `data/` (data.text.kinds, ...), which it imports on its first
# lookup: so `import data` stays light, and a new kind is named nowhere else.
KINDS: Registry[DataKind] = Registry("data kind", "data.name", "data", module="kinds")


def register_data_kind(kind: DataKind) -> None:
    """Make `kind` selectable as `data.name=<kind.name>`; a second kind with the same name is an error."""
    KINDS.register(kind.name, kind)


def list_data_kinds() -> list[str]:
    """The names `data.name` may take, sorted."""
    return KINDS.names()


def schema_name(schema: type) -> str:
    """The Hydra name of a schema, `<package>_schema` (text_schema, images_schema, squad_schema)."""
    parts = schema.__module__.split(".")
    return f"{parts[1] if len(parts) > 2 and parts[0] == 'data' else schema.__name__.lower()}_schema"


def data_schemas() -> dict[str, type]:
    """Every data schema by the name the `conf/data/*.yaml` defaults lists use, for registration with Hydra."""
    return {schema_name(kind.schema): kind.schema for kind in KINDS}


def get_data_kind(name: Any) -> DataKind:
    """The kind `data.name` selects; an unknown name is a ConfigError listing the known ones."""
    return KINDS.get(name)


def check_data(data_cfg: DictConfig, micro_batch_size: int) -> None:
    """Reject data values that cannot work before any worker starts (ConfigError naming `data.<key>`)."""
    kind = get_data_kind(data_cfg.get("name"))
    if "num_workers" in data_cfg:  # every kind's loader takes it
        with options_of("data"):
            check_non_negative("num_workers", data_cfg.num_workers)
    kind.check(data_cfg, micro_batch_size)


def build_data(data_cfg: DictConfig, request: DataRequest, dry: bool = False) -> TaskData | None:
    """This rank's training stream, held-out data and tokenizer for `data_cfg`.

    `dry=True` checks what can be checked without reading the dataset (paths, manifests, vocabularies; every
    shard's checksum too where the kind is asked to, `data.verify_shards`), writes nothing, and returns None.
    """
    return get_data_kind(data_cfg.get("name")).build(data_cfg, request, dry)


def require_file(path: Any, what: str) -> None:
    """A FileNotFoundError naming `path` unless it is an existing file or directory (dry builds)."""
    from pathlib import Path

    if path is None or not Path(path).expanduser().exists():
        raise FileNotFoundError(f"{what} not found: {path}")
