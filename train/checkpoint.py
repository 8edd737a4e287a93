"""Atomic, multi-rank checkpoints with retention of the last K and discovery of the newest complete one.

Layout: `<run>/checkpoints/step_00000200/` holds `shared.pt` (written by rank 0: state that is identical on
all ranks) and `rank_00000.pt` ... (each rank's own state: RNG streams, data position, and for optimizers
that keep per-rank state, the model and optimizer). A checkpoint is built in `step_N.tmp/` and renamed only
after every rank has written, so a directory without `.tmp` is always complete; a kill mid-save leaves a
`.tmp` directory that is ignored and later removed.

Best-K retention: `best.json` lists the `keep_best` checkpoints with the best evaluation score so far
(written atomically by rank 0); pruning keeps them besides the newest `keep_last`.
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

from optim.comm import Comm

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def atomic_torch_save(obj: Any, path: Path) -> None:
    """Write `obj` to `path` so that a reader sees either the old file or the complete new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    """Every random stream the training loop draws from, for bit-exact resume."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves and finds checkpoints of one run; every rank calls `save` and `load` together."""

    def __init__(self, directory: Path, keep_last: int, comm: Comm, keep_best: int = 0, best_mode: str = "max") -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.comm = comm
        self.keep_best = keep_best
        self.best_mode = best_mode  # max: higher scores are better (accuracy); min: lower (loss)

    def complete_checkpoints(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def save(self, step: int, shared: dict[str, Any], own: dict[str, Any]) -> Path:
        """Write one checkpoint: `shared` from rank 0 only, `own` from every rank; returns its directory."""
        final = self.directory / f"step_{step:08d}"
        staging = final.with_name(final.name + ".tmp")
        if self.comm.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.comm.barrier()
        atomic_torch_save(own, staging / f"rank_{self.comm.rank:05d}.pt")
        if self.comm.rank == 0:
            atomic_torch_save({**shared, "world_size": self.comm.world_size, "step": step}, staging / "shared.pt")
        self.comm.barrier()
        if self.comm.rank == 0:
            if final.exists():  # the same step saved again after a resume: replace it whole
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune()
        self.comm.barrier()
        return final

    def load(self, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read a checkpoint's shared state and this rank's own state; refuse a different world size."""
        path = Path(path)
        shared_file = path / "shared.pt"
        if not shared_file.is_file():
            raise FileNotFoundError(f"{shared_file} is missing: {path} is not a complete checkpoint")
        shared = torch.load(shared_file, map_location="cpu", weights_only=False)
        if shared["world_size"] != self.comm.world_size:
            raise RuntimeError(
                f"checkpoint {path} was written by {shared['world_size']} ranks but this run has "
                f"{self.comm.world_size}; resume with that many ranks, or start a new run "
                f"(another `name=`) with trainer.init_from={path} to keep only the weights"
            )
        own_file = path / f"rank_{self.comm.rank:05d}.pt"
        if not own_file.is_file():
            raise FileNotFoundError(f"{own_file} is missing: checkpoint {path} is incomplete")
        return shared, torch.load(own_file, map_location="cpu", weights_only=False)

    def best(self) -> list[dict[str, float]]:
        """The kept best checkpoints, best first: `[{"step": ..., "score": ...}, ...]`."""
        path = self.directory / "best.json"
        return json.loads(path.read_text()) if path.is_file() else []

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
            tmp = self.directory / "best.json.tmp"
            tmp.write_text(json.dumps(ranked[: self.keep_best], indent=1) + "\n")
            os.replace(tmp, self.directory / "best.json")
            self._prune()
        self.comm.barrier()

    def _prune(self) -> None:
        """Keep the newest `keep_last` checkpoints and the best ones; drop staging leftovers of interrupted saves."""
        protected = {f"step_{entry['step']:08d}" for entry in self.best()}
        for stale in self.complete_checkpoints()[: -self.keep_last]:
            if stale.name not in protected:
                shutil.rmtree(stale)
        for leftover in self.directory.glob("step_*.tmp"):
            shutil.rmtree(leftover, ignore_errors=True)
