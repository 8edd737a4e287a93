"""Atomic, multi-rank checkpoints with retention of the last K and discovery of the newest complete one.

Layout: `<run>/checkpoints/step_00000200/` holds `meta.json` (step, world size, optimizer: what a new invocation
checks before any worker starts), `shared.pt` (written by rank 0: state that is identical on all ranks) and
`rank_00000.pt` ... (each rank's own state: RNG streams, data position, and for optimizers
that keep per-rank state, the model and optimizer). A checkpoint is built in `step_N.tmp/` and renamed only
after every rank has written, so a directory without `.tmp` is always complete; a kill mid-save leaves a
`.tmp` directory that is ignored and later removed. Pruning renames a checkpoint to `step_N.pruned/` before
deleting it, for the same reason.

Another world size: `meta.json` lists under `rank_bound` the per-rank entries that tie a checkpoint to the
number of ranks that wrote it (the learner of a self-synchronising optimizer). When there are none (DDP
optimizers: the learner is in `shared.pt`), any number of ranks may resume it: the data position is global, so
every rank takes rank 0's (the loader re-partitions the rest of the epoch), and the RNG streams are left out, for
the caller to re-seed (`reseed_rng`). Otherwise the resume is refused in one line naming the choices.

Integrity: `meta.json` lists under `files` the size and SHA-256 of every other file of the checkpoint, computed by
the rank that wrote it and recorded before the checkpoint's rename makes it complete. Loading checks the files it
reads against them and names any that is missing, truncated or altered (`DamagedCheckpoint`); `Checkpointer.resume`
then passes over to the newest intact checkpoint, renaming the damaged ones `step_N.damaged/`. Checkpoints from
before checksums load unchecked. Every file is read with `torch.load(weights_only=True)`: tensors, containers and
the numpy arrays of the RNG state only, so a checkpoint from elsewhere cannot run code as it loads
(`UnsafeCheckpoint`).

Best-K retention: `best.json` lists the `keep_best` checkpoints with the best evaluation score so far
(written atomically by rank 0); pruning keeps them besides the newest `keep_last`.

This module is the only one that knows a checkpoint's layout (train.run_dir places the checkpoints in a run
directory): `init_checkpoint` finds the checkpoint of a run directory or a checkpoint directory that
`trainer.init_from` starts from, and `model_state` reads its weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.atomic import atomic_write, atomic_write_json, replace_directory
from core.errors import ConfigError, UserError
from optim.comm import Comm
from train.run_dir import RunDir
from train.stop import RunStopped

_STEP_DIR = re.compile(r"^step_(\d{8})$")
SHARED_FILE = "shared.pt"
META_FILE = "meta.json"
BEST_FILE = "best.json"
# Per-rank entries that do not bind a checkpoint to its world size: the data position is the same global one on
# every rank (see data/loader.py), so any rank may take rank 0's; RNG streams are re-seeded (`reseed_rng`) instead.
# Any other per-rank entry (a self-synchronising optimizer's learner) binds it to the ranks that wrote it.
GLOBAL_OWN_KEYS = ("data",)
RESEEDED_OWN_KEYS = ("rng",)
FILES_KEY = "files"  # meta.json: {file name: {"bytes": size, "sha256": hex digest}} of the checkpoint's other files
# What `torch.load(weights_only=True)` may build beyond tensors and containers: numpy's MT19937 state (`rng_state`).
SAFE_GLOBALS = (np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType)


class RunDirectoryError(ConfigError, RuntimeError):
    """A run directory whose checkpoints the requested run cannot continue (a user error: one line, exit 2)."""


class CheckpointNotSaved(RunStopped):
    """Another rank failed writing its part of a checkpoint (its own error is in its log): no checkpoint was made."""


def _error_line(error: BaseException) -> str:
    """What a rank tells the others of its failure: the exception's class and first line."""
    first = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


class DamagedCheckpoint(UserError):
    """A checkpoint file that is missing, truncated, altered or unreadable: the message names it."""


class UnsafeCheckpoint(DamagedCheckpoint):
    """A checkpoint file that holds objects other than tensors and containers, which loading would have to run."""


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save` that a reader sees whole or not at all (torch's zipfile format, which `load_torch` maps)."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def file_record(path: Path) -> dict[str, Any]:
    """What `meta.json` records of a checkpoint file: its size and SHA-256 (one read of the file: ~1.5 GB/s)."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def check_file(path: Path, record: dict[str, Any] | None) -> None:
    """Raise `DamagedCheckpoint` naming `path` if it is missing or differs from its `file_record` (None: a checkpoint
    from before checksums, whose file is only checked to exist)."""
    if not path.is_file():
        raise DamagedCheckpoint(f"{path} is missing: the checkpoint is incomplete")
    if record is None:
        return
    size = path.stat().st_size
    if size != record["bytes"]:
        raise DamagedCheckpoint(f"{path} is truncated or altered: {size} bytes where {record['bytes']} were written")
    if file_record(path)["sha256"] != record["sha256"]:
        raise DamagedCheckpoint(f"{path} is damaged: its SHA-256 differs from the one written with it")


def load_torch(path: Path, record: dict[str, Any] | None = None) -> Any:
    """A checkpoint file, checked against its `file_record` and memory-mapped.

    Memory-mapped: its tensors are read from the page cache on first touch instead of copied into each rank's
    memory, so the ranks of a node share one copy of `shared.pt` (~35 GB for BERT-XL with LAMB), and the mapping
    goes once its tensors are loaded into the model and optimizer (see `release_mapped`). Files are replaced by
    rename, never rewritten in place, so a mapping always sees the file it opened.
    Unpickled with `weights_only=True`: a file that would need more than `SAFE_GLOBALS` is refused unrun.
    """
    check_file(path, record)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        foreign = _foreign_globals(path)
        if not foreign:
            raise DamagedCheckpoint(f"{path} is unreadable: its pickle is damaged") from None
        raise UnsafeCheckpoint(f"{path} holds objects that are not plain tensors/containers ({', '.join(foreign)}); "
                               "refusing to unpickle it, as that would run their code: load only checkpoints this "
                               "project wrote") from None
    except (RuntimeError, EOFError, ValueError) as err:
        raise DamagedCheckpoint(f"{path} is unreadable (truncated or damaged): {str(err).splitlines()[0]}") from None


def _foreign_globals(path: Path) -> list[str]:
    """The classes and functions a checkpoint file's pickle names beyond what `load_torch` allows."""
    allowed = {f"{obj.__module__}.{obj.__qualname__}" for obj in SAFE_GLOBALS}
    try:
        return [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path) if name not in allowed]
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError):
        return []


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors inside nested dicts, lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    children = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, list | tuple) else ()
    return [tensor for child in children for tensor in _tensors(child)]


def release_mapped(loaded: Any, live: Any) -> None:
    """Give the tensors of `live` that still share memory with the loaded checkpoint `loaded` their own copy.

    An optimizer keeps the CPU tensors it is handed (its step counters; all of its state on a CPU run), which would
    keep the checkpoint file mapped for the whole run: on NFS, pruning that checkpoint later then fails (a deleted
    file that is still mapped is renamed `.nfs*` by the client, so its directory cannot be removed). Everything
    else is copied out on loading; this copies only these.
    """
    mapped = {tensor.untyped_storage().data_ptr() for tensor in _tensors(loaded)}
    with torch.no_grad():
        for tensor in _tensors(live):
            if tensor.untyped_storage().data_ptr() in mapped:
                tensor.set_(tensor.clone())


def rng_state() -> dict[str, Any]:
    """Every random stream the training loop draws from, for bit-exact resume.

    CUDA: only this rank's device's stream (`torch.cuda.current_device()`, set at start-up). Saving every visible
    GPU's would tie the checkpoint to the number of GPUs and to the rank-to-GPU mapping of the run that wrote it.
    """
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def reseed_rng(seed: int, rank: int, step: int) -> None:
    """Fresh streams for a rank that has no saved ones (a resume on another world size): keyed by the run's seed,
    the rank and the step, so they differ across ranks and from the streams of the run's first steps."""
    python_seed, numpy_seed, torch_seed = np.random.SeedSequence([seed, rank, step]).generate_state(3)
    random.seed(int(python_seed))
    np.random.seed(int(numpy_seed))
    torch.manual_seed(int(torch_seed))  # every CUDA device too


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoint directories in `directory`, oldest first (staging `.tmp` ones excluded)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


class Checkpointer:
    """Saves and finds checkpoints of one run; every rank calls `save` and `load` together."""

    def __init__(self, directory: Path, keep_last: int, comm: Comm, keep_best: int = 0, best_mode: str = "max") -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.comm = comm
        self.keep_best = keep_best
        self.best_mode = best_mode  # max: higher scores are better (accuracy); min: lower (loss)
        self.passed_over: list[str] = []  # a line for each damaged checkpoint `resume` passed over

    def complete_checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.directory)

    def latest(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
        """Write one checkpoint: `shared` and `meta` from rank 0 only, `own` from every rank; returns its directory."""
        final = self.directory / _step_dir(step)
        staging = final.with_name(final.name + ".tmp")
        if self.comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.comm.barrier()
        records = self._agreed(staging, lambda: self._write_own(staging, step, shared, own))
        self._agreed(staging, lambda: self._write_meta(staging, step, own, meta, records))
        if self.comm.rank == 0:
            replace_directory(staging, final)  # the same step saved again after a resume: replaced whole
            self._prune()
        self.comm.barrier()
        return final

    def _write_own(self, staging: Path, step: int, shared: dict[str, Any],
                   own: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """This rank's files of a checkpoint (rank 0 adds the shared state), each with its size and checksum (hashed
        by every rank in parallel, from the page cache)."""
        written = [_rank_file(self.comm.rank)]
        atomic_torch_save(own, staging / written[0])
        if self.comm.rank == 0:
            atomic_torch_save({**shared, "world_size": self.comm.world_size, "step": step}, staging / SHARED_FILE)
            written.append(SHARED_FILE)
        return [(name, file_record(staging / name)) for name in written]

    def _write_meta(self, staging: Path, step: int, own: dict[str, Any], meta: dict[str, Any] | None,
                    records: list[list[tuple[str, dict[str, Any]]]]) -> None:
        """Rank 0 records the checkpoint: `meta`, the step, the world size, the rank-bound keys and every file."""
        if self.comm.rank != 0:
            return
        files = dict(pair for rank_records in records for pair in rank_records)
        rank_bound = sorted(set(own) - {*GLOBAL_OWN_KEYS, *RESEEDED_OWN_KEYS})  # the same keys on every rank
        atomic_write_json(staging / META_FILE, {**(meta or {}), "step": step, "world_size": self.comm.world_size,
                                                "rank_bound": rank_bound, FILES_KEY: dict(sorted(files.items()))},
                          indent=1)

    def _agreed(self, staging: Path, write: Callable[[], Any]) -> list[Any]:
        """Run this rank's `write`, then let every rank know whether any rank's failed (a full disk, say), in one
        gather of each rank's result or error line: every rank then raises at once, rather than waiting in the
        next collective for a rank that left, and the partial checkpoint goes, not to fill the disk further.
        Returns every rank's result, in rank order."""
        failure: BaseException | None = None
        result = None
        try:
            result = write()
        except BaseException as error:  # re-raised below, after the vote
            failure = error
        outcomes = self.comm.all_gather_object(("failed", _error_line(failure)) if failure is not None
                                               else ("ok", result))
        failed = [(rank, line) for rank, (status, line) in enumerate(outcomes) if status == "failed"]
        if not failed:
            return [value for _, value in outcomes]
        shutil.rmtree(staging, ignore_errors=True)
        if failure is not None:
            raise failure
        rank, line = failed[0]
        raise CheckpointNotSaved(f"checkpoint {staging.name.removesuffix('.tmp')} was not saved: rank {rank} "
                                 f"failed writing its part ({line})")

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read a checkpoint's shared state and this rank's own state, each file checked against its checksum.

        On another world size (only for checkpoints without rank-bound state) the own state is rank 0's global
        data position alone: no `rng`, which the caller re-seeds. A damaged file, found by any rank, raises
        `DamagedCheckpoint` naming it on every rank, so that all of them take the same branch.
        """
        path = Path(path)
        try:
            loaded, problem = self._read(path), None
        except UserError as err:  # the world-size refusal too: no rank may leave before the others hear of it
            loaded, problem = None, err
        problems = [found for found in self.comm.all_gather_object(problem) if found is not None]
        if problems:
            raise problems[0]
        return loaded

    def _read(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        meta = read_meta(path)
        records = meta.get(FILES_KEY, {})
        # shared.pt is the same file for every rank: rank 0 checks it for them (it is the largest, and the ranks of
        # a node would each read it whole again), the others load it as it is; `load` shares rank 0's verdict.
        shared_record = records.get(SHARED_FILE) if self.comm.rank == 0 else None
        shared = load_torch(path / SHARED_FILE, shared_record)
        written_by = shared["world_size"]
        same_ranks = written_by == self.comm.world_size
        if not same_ranks:
            check_world_size(path, {**meta, "world_size": written_by}, self.comm.world_size)
        own_name = _rank_file(self.comm.rank if same_ranks else 0)
        own = load_torch(path / own_name, records.get(own_name))
        return shared, own if same_ranks else {key: own[key] for key in GLOBAL_OWN_KEYS if key in own}

    def resume(self) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
        """The newest checkpoint every rank reads intact, loaded (`load`); None when there is none to resume.

        Rank 0 lists the checkpoints for all (a stale view of shared storage on another node must not split the
        ranks). A damaged one is passed over for the one before it and renamed `step_N.damaged/` (kept for a look,
        out of the way of the saves and pruning to come), with a line in `passed_over` for the run's log. When all
        are damaged, `DamagedCheckpoint` names the newest's damage and nothing is renamed.
        """
        found = self.comm.broadcast_object(self.complete_checkpoints())
        damaged: list[tuple[Path, DamagedCheckpoint]] = []
        for path in reversed(found):
            try:
                loaded = self.load(path)
            except DamagedCheckpoint as err:
                damaged.append((path, err))
                continue
            self.passed_over = []
            for bad, err in damaged:
                aside = _free_name(bad.with_name(bad.name + ".damaged"))
                if self.comm.rank == 0:
                    os.replace(bad, aside)
                self.passed_over.append(f"warning: checkpoint {bad.name} passed over (moved to {aside.name}): {err}")
            return (path, *loaded)
        if damaged:
            raise DamagedCheckpoint(f"no intact checkpoint to resume in {self.directory} (the newest: {damaged[0][1]}):"
                                    " restore its files, or remove checkpoints/ to start over")
        return None

    def best(self) -> list[dict[str, float]]:
        """The kept best checkpoints, best first: `[{"step": ..., "score": ...}, ...]`."""
        return _ranked_best(self.directory)

    def is_among_best(self, score: float) -> bool:
        """Whether a checkpoint scoring `score` would enter the best `keep_best` (ties keep the older one)."""
        ranked = self.best()
        if self.keep_best <= 0:
            return False
        if len(ranked) < self.keep_best:
            return True
        worst = ranked[-1]["score"]
        return score > worst if self.best_mode == "max" else score < worst

    def record_best(self, step: int, score: float) -> None:
        """Enter the (already saved) checkpoint of `step` into the best list and prune what dropped out."""
        if self.comm.rank == 0:
            ranked = [entry for entry in self.best() if entry["step"] != step] + [{"step": step, "score": score}]
            # Stable sort: among equal scores the earlier checkpoint stays ahead.
            ranked.sort(key=lambda entry: -entry["score"] if self.best_mode == "max" else entry["score"])
            atomic_write_json(self.directory / BEST_FILE, ranked[: self.keep_best], indent=1)
            self._prune()
        self.comm.barrier()

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints and the best ones; drop leftovers of interrupted saves and prunes.

        A checkpoint is renamed out of the complete ones (`step_N.pruned`) before it is deleted, so a kill mid-delete
        never leaves a half-deleted directory under a checkpoint's name; the next prune removes it.
        """
        for leftover in [*self.directory.glob("step_*.tmp"), *self.directory.glob("step_*.pruned")]:
            shutil.rmtree(leftover, ignore_errors=True)
        protected = {_step_dir(entry["step"]) for entry in self.best()}
        for stale in self.complete_checkpoints()[: -self.keep_last]:
            if stale.name not in protected:
                doomed = stale.with_name(stale.name + ".pruned")
                os.replace(stale, doomed)
                shutil.rmtree(doomed)


def _free_name(path: Path) -> Path:
    """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
    candidate, number = path, 0
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def init_checkpoint(path: Path) -> Path | None:
    """The checkpoint `trainer.init_from=path` starts from: a run directory's newest one or the checkpoint directory
    itself; None for any other directory (a `save_pretrained` export, say)."""
    path = Path(path)
    checkpoints_dir = RunDir(path).checkpoints_dir
    if checkpoints_dir.is_dir():
        found = complete_checkpoints(checkpoints_dir)
        if not found:
            raise FileNotFoundError(f"trainer.init_from={path} is a run directory without checkpoints")
        path = found[-1]
    return path if (path / SHARED_FILE).is_file() else None


def best_checkpoint(directory: Path) -> Path | None:
    """The best of the checkpoints `best.json` keeps in `directory` (trainer.keep_best); None when it keeps none."""
    ranked = _ranked_best(Path(directory))
    return Path(directory) / _step_dir(ranked[0]["step"]) if ranked else None


def _ranked_best(directory: Path) -> list[dict[str, float]]:
    """`best.json` of a checkpoints directory, best first; [] before any checkpoint was ranked."""
    path = directory / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def model_state(path: Path) -> dict[str, torch.Tensor] | None:
    """The model weights of `init_checkpoint(path)` (the ranks' average where each rank keeps its own); None when
    there is none (a `save_pretrained` export, say), which the caller reads its own way."""
    path = init_checkpoint(path)
    if path is None:
        return None
    meta = read_meta(path)
    records = meta.get(FILES_KEY, {})
    state = load_torch(path / SHARED_FILE, records.get(SHARED_FILE))
    if "model" in state:
        return state["model"]
    # Self-synchronising optimizers keep the model with each rank, whose replicas may differ (SLAMB between its
    # dense averages): their average, as the trainer evaluates and exports it (train.replicas). Memory-mapped, the
    # ranks' files are read one tensor at a time.
    names = [_rank_file(rank) for rank in range(meta["world_size"])]
    states = [load_torch(path / name, records.get(name))["model"] for name in names]
    return {key: torch.stack([state[key] for state in states]).double().mean(0).to(value.dtype)
            if value.is_floating_point() else value for key, value in states[0].items()}


def check_world_size(checkpoint: Path, meta: dict[str, Any], world_size: int) -> None:
    """A checkpoint resumes on another number of ranks only when none of its per-rank state is bound to them."""
    written_by = meta["world_size"]
    rank_bound = meta["rank_bound"]
    if written_by == world_size or not rank_bound:
        return
    raise RunDirectoryError(
        f"checkpoint {checkpoint} was written by {written_by} ranks but this run has {world_size}, and "
        f"optim={meta['optimizer']} keeps per-rank state ({', '.join(rank_bound)}) that does not "
        f"re-partition: resume with {written_by} ranks, or start a new run (another name=...) with "
        f"trainer.init_from={checkpoint} to keep only the weights"
    )


def read_meta(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's `meta.json`; `DamagedCheckpoint` naming it when it is missing or cut."""
    path = Path(checkpoint) / META_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} is missing: the checkpoint is incomplete") from None
    except ValueError as err:  # JSON cut or garbled
        raise DamagedCheckpoint(f"{path} is unreadable (truncated or damaged): {err}") from None


def newest_checkpoint_meta(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint of `directory` whose `meta.json` reads, and that; a damaged one is left to
    `Checkpointer.resume` to pass over and report."""
    for checkpoint in reversed(complete_checkpoints(directory)):
        try:
            return checkpoint, read_meta(checkpoint)
        except DamagedCheckpoint:
            continue
    return None
