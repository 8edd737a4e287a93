"""Checkpoints: atomic directories, retention, newest-complete discovery, world-size rules, RNG capture, memory-mapped
loads, resume across precisions and with a stale view of shared storage."""

from __future__ import annotations

import errno
import gc
import json
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.config import TINY, compose
from helpers.distributed_harness import run_on_ranks
from helpers.runs import run_train

import train.checkpoint as checkpoint_module
from optim.comm import Comm
from train.checkpoint import (
    Checkpointer,
    DamagedCheckpoint,
    RunDirectoryError,
    UnsafeCheckpoint,
    complete_checkpoints,
    file_record,
    model_state,
    reseed_rng,
    rng_state,
    set_rng_state,
)
from train.metrics import read_metrics
from train.plan import plan_run
from train.run import run


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
    shared = torch.load(path / "shared.pt", weights_only=True)
    torch.save({**shared, "world_size": world_size}, path / "shared.pt")
    _record_again(path, "shared.pt")


def _record_again(checkpoint: Path, name: str) -> None:
    """Record a checkpoint file's new content in its meta.json, as if it had been written so."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][name] = file_record(checkpoint / name)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_world_size_mismatch_with_rank_bound_state_is_a_clear_error(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(5, {}, {"model": {}, "optimizer": {}, "rng": rng_state()}, meta={"optimizer": "slamb"})
    assert json.loads((path / "meta.json").read_text())["rank_bound"] == ["model", "optimizer"]
    _as_if_written_by(path, 4)
    with pytest.raises(RunDirectoryError, match=r"written by 4 ranks but this run has 1, and optim=slamb keeps "
                                                 r"per-rank state \(model, optimizer\) .*: resume with 4 ranks"):
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
    with pytest.raises(DamagedCheckpoint, match=r"rank_00000\.pt is missing"):
        ckpt.load(path)


def test_rng_state_restores_every_stream():
    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(2))
    set_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(2))
    assert first[0] == second[0] and first[1] == second[1]
    assert torch.equal(first[2], second[2])


# ----------------------------------------------------------------------------------------- CUDA random streams
class _FakeCuda:
    """`torch.cuda`'s RNG functions for `devices` GPUs of which this rank uses `current`, without a GPU."""

    def __init__(self, monkeypatch, devices: int, current: int) -> None:
        self.restored: list[tuple[torch.Tensor, int]] = []
        for name, value in (("is_available", lambda: True), ("is_initialized", lambda: True),
                            ("device_count", lambda: devices), ("current_device", lambda: current),
                            ("get_rng_state", self.get_rng_state), ("set_rng_state", self.set_rng_state)):
            monkeypatch.setattr(torch.cuda, name, value)

    @staticmethod
    def get_rng_state(device: int) -> torch.Tensor:
        return torch.full((4,), device, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: int) -> None:
        self.restored.append((state, device))


def test_cuda_rng_state_is_this_devices_alone_and_restores_on_fewer_gpus(monkeypatch):
    with monkeypatch.context() as patch:
        _FakeCuda(patch, devices=8, current=5)
        saved = rng_state()
    assert torch.equal(saved["cuda"], torch.full((4,), 5, dtype=torch.uint8))  # one tensor: cuda:5's stream

    fake = _FakeCuda(monkeypatch, devices=1, current=0)  # resumed where this rank sees one GPU
    set_rng_state(saved)
    assert len(fake.restored) == 1 and torch.equal(fake.restored[0][0], saved["cuda"]) and fake.restored[0][1] == 0


# ----------------------------------------------------------------------------------------- memory-mapped loads
def _series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


def _mapped_files() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_checkpoint_files_are_memory_mapped_not_copied(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(3, {"model": {"w": torch.arange(1000.0)}}, {"data": {"index": 3}, "x": torch.ones(100)})
    shared, own = ckpt.load(path)
    assert str(path / "shared.pt") in _mapped_files() and str(path / "rank_00000.pt") in _mapped_files()
    assert torch.equal(shared["model"]["w"], torch.arange(1000.0)) and torch.equal(own["x"], torch.ones(100))
    del shared, own
    gc.collect()
    assert str(path) not in _mapped_files()  # unmapped once the last tensor is gone


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc/self/maps")
def test_a_resumed_trainer_keeps_no_mapping_of_its_checkpoint_and_repeats_the_series(tmp_path):
    from train.trainer import Trainer

    args = [*TINY, "trainer.max_steps=4"]
    run(compose(args), tmp_path / "ref")
    run(compose([*args, "trainer.steps_this_run=2"]), tmp_path / "resumed")
    # LAMB's state on CPU: handed the loaded tensors
    trainer = Trainer(plan_run(compose(args), tmp_path / "resumed"), Comm())
    assert trainer.step == 2
    gc.collect()
    assert str(tmp_path / "resumed" / "checkpoints") not in _mapped_files()
    trainer.fit()
    trainer.close()
    assert _series(tmp_path / "resumed") == _series(tmp_path / "ref")  # bit-identical


# ----------------------------------------------------------------------------------------- another precision
@pytest.mark.parametrize("first, then", [("bf16", "fp16"), ("fp16", "bf16"), ("fp32", "fp16")])
def test_resume_with_another_precision_starts_or_drops_the_loss_scale(tmp_path, first, then):
    args = [*TINY, "trainer.max_steps=4"]
    run(compose([*args, f"precision={first}", "trainer.steps_this_run=2"]), tmp_path)
    run(compose([*args, f"precision={then}"]), tmp_path)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert ["loss_scale" in r for r in records] == [first == "fp16"] * 2 + [then == "fp16"] * 2
    if then == "fp16":  # a fresh scaler: init_scale, halved on each overflowing (skipped) step
        assert records[2]["loss_scale"] == compose(["precision=fp16"]).precision.init_scale / 2 ** records[2][
            "skipped_steps"]


# ----------------------------------------------------------------------------------------- stale shared storage
def _resume_twice_with_a_stale_listing_on_rank_1(rank: int, world_size: int, tmp_path: Path) -> list[tuple]:
    """Two invocations of a 6-step run (4 steps, then the rest) on 2 ranks whose rank 1 lists the checkpoint
    directory as a lagging NFS client would: without its newest checkpoint. (resumed at, stopped at) per run."""
    import torch.distributed as dist

    from train.trainer import Trainer

    # A rank left alone in a collective fails after 20 s instead of the default 30 min.
    comm = Comm(dist.new_group(backend="gloo", timeout=timedelta(seconds=20)))
    steps = []
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            listed = Checkpointer.complete_checkpoints
            patch.setattr(Checkpointer, "complete_checkpoints", lambda self: listed(self)[:-1])
        for _ in range(2):
            plan = plan_run(compose([*TINY, "trainer.steps_this_run=4", f"trainer.nproc_per_node={world_size}"]),
                            tmp_path)
            trainer = Trainer(plan, comm)
            resumed_at = trainer.step
            trainer.fit()  # checkpoints at 2 and 4, then the stop's checkpoint of step 4 again (already saved)
            trainer.close()
            steps.append((resumed_at, trainer.step))
    return steps


@pytest.mark.slow
def test_ranks_with_a_stale_view_of_the_checkpoints_save_and_resume_the_same_steps(tmp_path):
    assert run_on_ranks(_resume_twice_with_a_stale_listing_on_rank_1, 2, tmp_path) == [[(0, 4), (4, 6)]] * 2
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000002", "step_00000004", "step_00000006"]


def test_a_kill_mid_prune_leaves_only_loadable_checkpoints_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    ckpt.save(2, {"x": 2}, {})

    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, *args, **kwargs):  # deleting a checkpoint: its first file goes, then the process dies
        if not (Path(path) / "shared.pt").is_file():
            return real_rmtree(path, *args, **kwargs)
        (Path(path) / "shared.pt").unlink()
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("train.checkpoint.shutil.rmtree", killed_mid_delete)
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(4, {"x": 4}, {})
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step_00000004"]
    for checkpoint in ckpt.complete_checkpoints():
        assert ckpt.load(checkpoint)[0]["x"] == 4
    ckpt.save(6, {"x": 6}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006"]


# ----------------------------------------------------------------------------------------- integrity
def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_meta_records_the_size_and_sha256_of_every_file(tmp_path):
    import hashlib

    path = Checkpointer(tmp_path, keep_last=1, comm=Comm()).save(2, {"model": {"w": torch.ones(3)}}, {"data": {}})
    files = json.loads((path / "meta.json").read_text())["files"]
    assert sorted(files) == ["rank_00000.pt", "shared.pt"]
    for name, record in files.items():
        content = (path / name).read_bytes()
        assert record == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def test_a_flipped_byte_is_named_and_resume_passes_over_to_the_checkpoint_before(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=3, comm=Comm())
    for step in (2, 4):
        ckpt.save(step, {"model": {"w": torch.full((64,), float(step))}}, {"data": {"index": step}})
    _flip_byte(tmp_path / "step_00000004" / "shared.pt")
    with pytest.raises(DamagedCheckpoint, match=r"step_00000004/shared\.pt is damaged: its SHA-256 differs"):
        ckpt.load(tmp_path / "step_00000004")

    path, shared, own = ckpt.resume()
    assert path.name == "step_00000002" and shared["step"] == 2 and own == {"data": {"index": 2}}
    assert ckpt.passed_over == ["warning: checkpoint step_00000004 passed over (moved to step_00000004.damaged): "
                                f"{tmp_path}/step_00000004/shared.pt is damaged: its SHA-256 differs from the one "
                                "written with it"]
    # Out of the way: the next saves and prunes see step 2 as the newest; the damaged files are kept for a look.
    assert [p.name for p in ckpt.complete_checkpoints()] == ["step_00000002"]
    assert (tmp_path / "step_00000004.damaged" / "shared.pt").is_file()


def test_a_truncated_rank_file_is_named_with_or_without_checksums(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(2, {}, {"data": {"index": 2}, "rng": rng_state()})
    rank_file = path / "rank_00000.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:500])
    with pytest.raises(DamagedCheckpoint, match=r"rank_00000\.pt is truncated or altered: 500 bytes where \d+ were"):
        ckpt.load(path)
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]  # a checkpoint from before checksums: torch's reader finds the cut, and the file is named
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DamagedCheckpoint, match=r"rank_00000\.pt is unreadable \(truncated or damaged\)"):
        ckpt.load(path)
    with pytest.raises(DamagedCheckpoint, match=r"no intact checkpoint to resume in .*: restore its files"):
        ckpt.resume()


def test_a_checkpoint_from_before_checksums_still_loads(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=1, comm=Comm())
    path = ckpt.save(2, {"model": {"w": torch.ones(2)}}, {"data": {"index": 2}, "rng": rng_state()})
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    shared, own = ckpt.load(path)
    assert torch.equal(shared["model"]["w"], torch.ones(2)) and own["data"] == {"index": 2}


class Foreign:
    """A class a checkpoint from elsewhere could carry: unpickling it would call `os.system`."""

    def __reduce__(self):
        import os

        return os.system, ("touch pwned",)


@pytest.mark.parametrize("recorded", [True, False])
def test_a_pickle_with_an_arbitrary_class_is_refused_unrun(tmp_path, monkeypatch, recorded):
    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=1, comm=Comm())
    path = ckpt.save(2, {"model": {"w": torch.ones(2)}}, {"data": {}})
    torch.save({"model": {"w": torch.ones(2)}, "world_size": 1, "step": 2, "extra": Foreign()}, path / "shared.pt")
    if recorded:  # its checksum matches: it was written so, by someone else
        _record_again(path, "shared.pt")
    else:
        meta = json.loads((path / "meta.json").read_text())
        del meta["files"]
        (path / "meta.json").write_text(json.dumps(meta))
    refusal = r"shared\.pt holds objects that are not plain tensors/containers \(posix\.system\); refusing to unpickle"
    with pytest.raises(UnsafeCheckpoint, match=refusal):
        ckpt.load(path)
    with pytest.raises(UnsafeCheckpoint, match=refusal):  # trainer.init_from, train.export, train.evaluate
        model_state(path)
    assert not (tmp_path / "pwned").exists()


def test_a_damaged_newest_checkpoint_resumes_the_one_before_and_repeats_the_series(tmp_path, capsys):
    args = [*TINY, "trainer.keep_last=3"]
    run(compose(args), tmp_path / "ref")
    run(compose([*args, "trainer.steps_this_run=4"]), tmp_path / "cut")
    _flip_byte(tmp_path / "cut" / "checkpoints" / "step_00000004" / "shared.pt")
    capsys.readouterr()
    run(compose(args), tmp_path / "cut")
    out = capsys.readouterr().out
    assert "warning: checkpoint step_00000004 passed over (moved to step_00000004.damaged)" in out
    assert f"resumed from {tmp_path / 'cut' / 'checkpoints' / 'step_00000002'} at step 2" in out
    assert _series(tmp_path / "cut") == _series(tmp_path / "ref")


def test_no_intact_checkpoint_is_one_line_and_exit_2(tmp_path):
    args = [*TINY, "trainer.max_steps=4", "trainer.steps_this_run=2", f"hydra.run.dir={tmp_path}"]
    run(compose(args), tmp_path)
    _flip_byte(tmp_path / "checkpoints" / "step_00000002" / "rank_00000.pt")
    result = run_train(args)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: no intact checkpoint to resume in {tmp_path / 'checkpoints'} (the newest: {tmp_path}/checkpoints/"
        "step_00000002/rank_00000.pt is damaged: its SHA-256 differs from the one written with it): restore its "
        "files, or remove checkpoints/ to start over"]


def _resume_with_rank_1s_newest_file_damaged(rank: int, world_size: int, tmp_path: Path) -> tuple:
    """Two saves on 2 ranks, then rank 1's file of the newest cut: (resumed step, own state, passed-over lines)."""
    comm = Comm()
    ckpt = Checkpointer(tmp_path, keep_last=2, comm=comm)
    for step in (2, 4):
        ckpt.save(step, {"model": {"w": torch.ones(2)}}, {"data": {"index": step}, "mine": torch.tensor(rank)})
    comm.barrier()
    if rank == 1:  # only rank 1 reads (and checks) its file: the ranks must still agree
        damaged = tmp_path / "step_00000004" / "rank_00001.pt"
        damaged.write_bytes(damaged.read_bytes()[:-10])
    comm.barrier()
    path, _, own = ckpt.resume()
    return path.name, int(own["mine"]), ckpt.passed_over


def test_ranks_agree_to_pass_over_a_checkpoint_only_one_of_them_finds_damaged(tmp_path):
    results = run_on_ranks(_resume_with_rank_1s_newest_file_damaged, 2, tmp_path)
    assert [result[:2] for result in results] == [("step_00000002", 0), ("step_00000002", 1)]
    assert "rank_00001.pt is truncated or altered" in results[0][2][0]  # rank 0, which logs, names rank 1's file


def _save_with_rank_1s_disk_full(rank: int, world_size: int, tmp_path: Path) -> tuple:
    """A save at step 2 whose rank-1 write finds no space, then one at step 4: (what each save raised, the
    checkpoints left, the seconds the failed save took)."""
    ckpt = Checkpointer(tmp_path, keep_last=2, comm=Comm())
    write = checkpoint_module.atomic_torch_save

    def full(obj, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    checkpoint_module.atomic_torch_save = full if rank == 1 else write
    start = time.monotonic()
    try:
        ckpt.save(2, {"model": {"w": torch.ones(2)}}, {"data": {"index": 2}})
        raised = None
    except Exception as error:  # what each rank raises
        raised = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - start
    checkpoint_module.atomic_torch_save = write  # space again: the ranks are still in step
    ckpt.save(4, {"model": {"w": torch.ones(2)}}, {"data": {"index": 4}})
    return raised, sorted(p.name for p in tmp_path.iterdir()), seconds


def test_a_rank_that_fails_mid_save_stops_every_rank_at_once_and_leaves_no_checkpoint(tmp_path):
    results = run_on_ranks(_save_with_rank_1s_disk_full, 2, tmp_path)
    (raised_0, left, seconds_0), (raised_1, _, seconds_1) = results
    assert raised_1.startswith("OSError: [Errno 28] No space left on device")
    assert raised_0 == ("CheckpointNotSaved: checkpoint step_00000002 was not saved: rank 1 failed writing its part "
                        f"(OSError: [Errno 28] No space left on device: '{tmp_path}/step_00000002.tmp/rank_00001.pt')")
    assert max(seconds_0, seconds_1) < 30  # not the process group's time-out
    assert left == ["step_00000004"]  # no partial step_00000002, nor its staging
