"""Checkpoints: atomic directories, retention, newest-complete discovery, world-size rules, RNG capture."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from optim.comm import Comm
from train.checkpoint import Checkpointer, RunDirectoryError, reseed_rng, rng_state, set_rng_state


def test_save_load_roundtrip_and_retention(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2, comm=Comm())
    for step in (2, 4, 6):
        ckpt.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"data": {"index": step}})
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step_00000004", "step_00000006"]
    shared, own = ckpt.load(ckpt.latest())
    assert shared["step"] == 6 and shared["world_size"] == 1
    assert torch.equal(shared["model"]["w"], torch.full((3,), 6.0))
    assert own == {"data": {"index": 6}}


def test_interrupted_save_is_ignored_and_cleaned(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=3, comm=Comm())
    ckpt.save(1, {"x": 1}, {})
    half_written = tmp_path / "step_00000002.tmp"
    half_written.mkdir()
    (half_written / "rank_00000.pt").write_bytes(b"partial")
    assert ckpt.latest().name == "step_00000001"
    ckpt.save(3, {"x": 3}, {})
    assert not half_written.exists()


def _as_if_written_by(path, world_size: int) -> None:
    shared = torch.load(path / "shared.pt", weights_only=False)
    torch.save({**shared, "world_size": world_size}, path / "shared.pt")


def test_world_size_mismatch_with_rank_bound_state_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {}, {"model": {}, "optimizer": {}, "rng": rng_state()}, meta={"optimizer": "slamb"})
    assert json.loads((path / "meta.json").read_text())["rank_bound"] == ["model", "optimizer"]
    _as_if_written_by(path, 4)
    with pytest.raises(RunDirectoryError, match=r"written by 4 ranks but this run has 1, and optim=slamb keeps "
                                                 r"per-rank state \(model, optimizer\) .*: resume with 4 ranks"):
        ckpt.load(path)


def test_world_size_mismatch_without_a_record_is_refused(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {}, {"data": {"index": 8}})
    (path / "meta.json").unlink()  # as written before checkpoints recorded their rank-bound state
    _as_if_written_by(path, 2)
    with pytest.raises(RunDirectoryError, match="does not record whether its per-rank state re-partitions"):
        ckpt.load(path)


def test_portable_checkpoint_loads_on_another_world_size_without_rng(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {"model": {"w": torch.ones(2)}}, {"data": {"epoch": 0, "index": 16}, "rng": rng_state()})
    assert json.loads((path / "meta.json").read_text())["rank_bound"] == []
    _as_if_written_by(path, 2)
    shared, own = ckpt.load(path)
    assert torch.equal(shared["model"]["w"], torch.ones(2))
    assert own == {"data": {"epoch": 0, "index": 16}}  # the global position; RNG streams are re-seeded


def test_reseeded_streams_differ_across_ranks_and_steps_and_repeat_for_the_same_key():
    draws = {}
    for key in [(0, 3), (1, 3), (0, 4), (0, 3)]:
        reseed_rng(42, *key)
        draws.setdefault(key, []).append((random.random(), float(np.random.rand()), torch.rand(1).item()))
    assert draws[(0, 3)][0] == draws[(0, 3)][1]
    assert len({draws[key][0] for key in draws}) == 3


def test_missing_rank_file_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {}, {})
    (path / "rank_00000.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"rank_00000\.pt is missing"):
        ckpt.load(path)


def test_rng_state_restores_every_stream():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(2))
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2])
