"""Atomic writes: a reader sees a path's old content or all of the new one, never a partial file or tree.

Files are written to a temporary sibling (`.<name>.tmp-<host>-<pid>-<random>`, so a leftover of a killed writer is
recognisable and never mistaken for a finished file), flushed, fsynced and renamed into place; the rename is
made durable by fsyncing the directory. Directories are built completely under such a staging name first
(`staging_directory`), which first removes what killed writers of the same path on this host left.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

PathLike = str | os.PathLike[str]


def _fsync_directory(directory: Path) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_sibling(path: PathLike) -> Path:
    """A unique temporary name beside `path` (same directory, so the final rename is atomic), naming this host and
    process: `remove_stale_temporaries` knows by them whether its writer is gone."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_stale_temporaries(path: PathLike) -> list[Path]:
    """Remove the temporary siblings of `path` whose writer was a process of this host that no longer runs (a
    killed save or export); returns them. Another host's, and a running writer's, are left alone."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.tmp-{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]{{8}}$")
    removed = []
    for sibling in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        match = pattern.match(sibling.name)
        if match is None or _running(int(match.group(1))):
            continue
        if sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            sibling.unlink(missing_ok=True)
        removed.append(sibling)
    return removed


def staging_directory(final: PathLike) -> Path:
    """A new empty directory beside `final` to build its next content in (`replace_directory` then puts it in
    place), after removing what killed writers of `final` left there."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final)
    staging = temporary_sibling(final)
    staging.mkdir()
    return staging


def _running(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts: it is not ours to remove)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write(path: PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Run `write` on a temporary file beside `path`, then rename it over `path`, so no crash leaves half a file.

    E.g. `atomic_write(path, lambda f: torch.save(obj, f))`.
    """
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def atomic_write_text(path: PathLike, text: str) -> None:
    """`atomic_write` of UTF-8 text."""
    data = text.encode("utf-8")
    atomic_write(path, lambda handle: handle.write(data))


def atomic_write_json(path: PathLike, obj: Any, **json_kwargs: Any) -> None:
    """`atomic_write` of `json.dumps(obj, **json_kwargs)` plus a final newline (manifests, records, predictions)."""
    atomic_write_text(path, json.dumps(obj, **json_kwargs) + "\n")


def replace_directory(staging: PathLike, final: PathLike) -> None:
    """Put the fully written directory `staging` in `final`'s place; an old `final` is removed afterwards.

    The old tree is renamed aside before the new one is renamed in, so `final` is either the old complete tree
    or the new complete one, apart from the instant between the two renames.
    """
    staging, final = Path(staging), Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
    os.replace(staging, final)
    _fsync_directory(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
