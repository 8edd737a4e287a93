"""Training data: generic resumable loading, and the data kinds (text, images, SQuAD) chosen by `data.name`.

Subpackages by feature: `data.text` (tokenizer, masking, NSP, shards, pretraining datasets), `data.corpus`
(the offline `python -m data.prepare` pipeline), `data.images` and `data.squad`. This package imports neither
`optim` nor `train`: plain integers go in (`DataRequest`), a `TaskData` comes out.
"""

from core.atomic import atomic_write, atomic_write_json, atomic_write_text, replace_directory
from data._registry import (
    DataKind,
    DataRequest,
    TaskData,
    build_data,
    check_data,
    data_schemas,
    list_data_kinds,
)
from data.loader import ResumableLoader
from data.sampler import ResumableDistributedSampler

__all__ = [
    "DataKind",
    "DataRequest",
    "ResumableDistributedSampler",
    "ResumableLoader",
    "TaskData",
    "atomic_write",
    "atomic_write_json",
    "atomic_write_text",
    "build_data",
    "check_data",
    "data_schemas",
    "list_data_kinds",
    "replace_directory",
]
