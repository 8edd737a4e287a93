"""Atomic file and directory writes: a reader sees the old content or the complete new one, never a part."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write` on a temporary file beside `path`, flush and fsync it, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text.encode()))


def atomic_write_json(path: str | Path, obj: Any, **json_kwargs: Any) -> None:
    atomic_write_text(path, json.dumps(obj, **json_kwargs) + "\n")


def replace_directory(staging: str | Path, final: str | Path) -> None:
    """Put a fully written `staging` directory in `final`'s place (an old `final` is removed first)."""
    final = Path(final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
