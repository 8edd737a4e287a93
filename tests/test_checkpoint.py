"""Checkpoints: atomic directories, retention, newest-complete discovery, world-size checks, RNG capture."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from optim.comm import Comm
from train.checkpoint import Checkpointer, rng_state, set_rng_state


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


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {}, {})
    shared = torch.load(path / "shared.pt", weights_only=False)
    shared["world_size"] = 4
    torch.save(shared, path / "shared.pt")
    with pytest.raises(RuntimeError, match="written by 4 ranks but this run has 1"):
        ckpt.load(path)


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
