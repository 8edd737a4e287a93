"""`trainer.deterministic`: the switches it sets (CPU), and a bit-exact resume on a GPU with it (needs CUDA)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.config import TINY, compose
from helpers.runs import popen_train, run_train

from train.metrics import read_metrics
from train.precision import set_deterministic
from train.run import run


@pytest.fixture
def restore_determinism(monkeypatch):
    """Leave the process's switches as the other tests expect them (the trainer sets them process-wide)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored (absent or not) at teardown
    benchmark = torch.backends.cudnn.benchmark
    yield
    set_deterministic(False)
    torch.backends.cudnn.benchmark = benchmark


def test_deterministic_sets_torch_cudnn_and_cublas_switches_and_off_clears_them(tmp_path, restore_determinism):
    torch.backends.cudnn.benchmark = True
    run(compose([*TINY, "trainer.max_steps=2", "trainer.deterministic=true"]), tmp_path / "on")  # trains on CPU too
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert [r["step"] for r in read_metrics(tmp_path / "on")] == [1, 2]

    run(compose([*TINY, "trainer.max_steps=1"]), tmp_path / "off")  # the default: false
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic


def _series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deterministic_gpu_resume_repeats_the_loss_series_exactly(tmp_path, precision):
    # Fresh processes: cuBLAS reads its workspace setting once per process, at its first handle. Dropout on and
    # dynamic masking, so the CUDA random stream and the data position must both be restored.
    args = [*TINY, "trainer.device=cuda", "trainer.deterministic=true", f"precision={precision}",
            "trainer.max_steps=10", "trainer.checkpoint_every=0", "data.masking=dynamic"]
    # The reference beside the first part (two processes' start-up in one's time, the GPU command's longest tests)
    reference = popen_train([*args, f"hydra.run.dir={tmp_path / 'ref'}"])
    for steps_this_run in ("trainer.steps_this_run=4", "trainer.steps_this_run=null"):  # stopped at 4, resumed
        part = run_train([*args, steps_this_run, f"hydra.run.dir={tmp_path / 'resumed'}"])
        assert part.returncode == 0, part.stderr[-3000:]
    assert "resumed from" in part.stdout + part.stderr
    _, errors = reference.communicate(timeout=300)
    assert reference.returncode == 0, errors[-3000:]
    assert _series(tmp_path / "resumed") == _series(tmp_path / "ref")  # bit-identical floats, every step once
    assert len(_series(tmp_path / "ref")) == 10
