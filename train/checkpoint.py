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

Best-K retention: `best.json` lists the `keep_best` checkpoints with the best evaluation score so far
(written atomically by rank 0); pruning keeps them besides the newest `keep_last`.

This module is the only one that knows a checkpoint's layout (train.run_dir places the checkpoints in a run
directory): `init_checkpoint` finds the checkpoint of a run directory or a checkpoint directory that
`trainer.init_from` starts from, and `model_state` reads its weights.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conf.checks import ConfigError
from data.atomic import atomic_write, atomic_write_json, replace_directory
from optim.comm import Comm
from train.run_dir import RunDir

_STEP_DIR = re.compile(r"^step_(\d{8})$")
SHARED_FILE = "shared.pt"
META_FILE = "meta.json"
BEST_FILE = "best.json"
# Per-rank entries that do not bind a checkpoint to its world size: the data position is the same global one on
# every rank (see data/loader.py), so any rank may take rank 0's; RNG streams are re-seeded (`reseed_rng`) instead.
# Any other per-rank entry (a self-synchronising optimizer's learner) binds it to the ranks that wrote it.
GLOBAL_OWN_KEYS = ("data",)
RESEEDED_OWN_KEYS = ("rng",)


class RunDirectoryError(ConfigError, RuntimeError):
    """A run directory whose checkpoints the requested run cannot continue (a user error: one line, exit 2)."""


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _step_dir(step: int) -> str:
    return f"step_{step:08d}"


def atomic_torch_save(obj: Any, path: Path) -> None:
    """`torch.save` that a reader sees whole or not at all (torch's zipfile format, which `load_torch` maps)."""
    atomic_write(path, lambda handle: torch.save(obj, handle))


def load_torch(path: Path) -> Any:
    """A checkpoint file, memory-mapped: its tensors are read from the page cache on first touch instead of copied
    into each rank's memory, so the ranks of a node share one copy of `shared.pt` (~35 GB for BERT-XL with LAMB),
    and the mapping goes once its tensors are loaded into the model and optimizer (see `release_mapped`). Files are
    replaced by rename, never rewritten in place, so a mapping always sees the file it opened."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


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

    def complete_checkpoints(self) -> list[Path]:
        return complete_checkpoints(self.directory)

    def latest(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def agreed_latest(self) -> Path | None:
        """Rank 0's newest checkpoint, on every rank: on shared file systems another node may list a stale
        directory, and replicas must resume from the same step."""
        return self.comm.broadcast_object(self.latest())

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any], meta: dict[str, Any] | None = None) -> Path:
        """Write one checkpoint: `shared` and `meta` from rank 0 only, `own` from every rank; returns its directory."""
        final = self.directory / _step_dir(step)
        staging = final.with_name(final.name + ".tmp")
        if self.comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.comm.barrier()
        try:
            atomic_torch_save(own, staging / _rank_file(self.comm.rank))
            if self.comm.rank == 0:
                atomic_torch_save({**shared, "world_size": self.comm.world_size, "step": step}, staging / SHARED_FILE)
                rank_bound = sorted(set(own) - {*GLOBAL_OWN_KEYS, *RESEEDED_OWN_KEYS})  # the same keys on every rank
                atomic_write_json(staging / META_FILE, {**(meta or {}), "step": step,
                                                        "world_size": self.comm.world_size, "rank_bound": rank_bound})
        except BaseException:  # a full disk, say: the partial checkpoint goes, not to fill it further
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.comm.barrier()
        if self.comm.rank == 0:
            replace_directory(staging, final)  # the same step saved again after a resume: replaced whole
            self._prune()
        self.comm.barrier()
        return final

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read a checkpoint's shared state and this rank's own state.

        On another world size (only for checkpoints without rank-bound state) the own state is rank 0's global
        data position alone: no `rng`, which the caller re-seeds.
        """
        path = Path(path)
        shared_file = path / SHARED_FILE
        if not shared_file.is_file():
            raise FileNotFoundError(f"{shared_file} is missing: {path} is not a complete checkpoint")
        shared = load_torch(shared_file)
        written_by = shared["world_size"]
        same_ranks = written_by == self.comm.world_size
        if not same_ranks:
            check_world_size(path, {**read_meta(path), "world_size": written_by}, self.comm.world_size)
        own_file = path / _rank_file(self.comm.rank if same_ranks else 0)
        if not own_file.is_file():
            raise FileNotFoundError(f"{own_file} is missing: checkpoint {path} is incomplete")
        own = load_torch(own_file)
        return shared, own if same_ranks else {key: own[key] for key in GLOBAL_OWN_KEYS if key in own}

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
    state = load_torch(path / SHARED_FILE)
    if "model" in state:
        return state["model"]
    # Self-synchronising optimizers keep the model with each rank, whose replicas may differ (SLAMB between its
    # dense averages): their average, as the trainer evaluates and exports it (train.replicas). Memory-mapped, the
    # ranks' files are read one tensor at a time.
    states = [load_torch(path / _rank_file(rank))["model"] for rank in range(read_meta(path)["world_size"])]
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
    """A checkpoint's `meta.json`."""
    return json.loads((Path(checkpoint) / META_FILE).read_text())


def newest_checkpoint_meta(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint of `directory` and its `meta.json`."""
    found = complete_checkpoints(directory)
    return (found[-1], read_meta(found[-1])) if found else None
