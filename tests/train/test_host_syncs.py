"""The training step reads nothing from the device on its hot path (CUDA-free: host reads are counted by patching).

On a GPU every `.item()`, `bool(tensor)`, `float(tensor)` or `.tolist()` waits for the device. The trainer's step
(loop, task, grad-sync policy, clipping, loss scaler) must not do any under fp32/bf16, and at most one under fp16:
the scaler's own read of its overflow flag. The optimizers' internals are checked by their own tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.config import REPO, TINY, compose
from helpers.host_reads import count_host_reads

from optim.comm import Comm
from train.plan import plan_run
from train.trainer import Trainer

_WATCHED = (str(REPO / "train"), "torch/amp/grad_scaler.py", "torch/nn/utils/clip_grad.py")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads of tensors made directly by the trainer, the loss scaler or gradient clipping."""
    return count_host_reads(monkeypatch, *_WATCHED)


@pytest.mark.parametrize(("precision", "allowed"), [("fp32", 0), ("bf16", 0), ("fp16", 1)])
def test_train_step_makes_no_host_sync(tmp_path: Path, host_reads: list[str], precision: str, allowed: int):
    cfg = compose([*TINY, f"precision={precision}", "trainer.micro_batch_size=2"])  # 4 micro-batches per step
    trainer = Trainer(plan_run(cfg, tmp_path), Comm())
    trainer.train_step()  # the first step creates optimizer state
    host_reads.clear()
    for _ in range(3):
        before = len(host_reads)
        trainer.train_step()
        assert len(host_reads) - before <= allowed, host_reads[before:]
    trainer.logger.close()


def test_the_counter_sees_a_host_read(host_reads: list[str]):
    """The patch really counts: a read made from a watched file is recorded."""
    from train import grad_sync

    code = compile("torch.ones(()).item()", grad_sync.__file__, "exec")
    exec(code, {"torch": torch})
    assert len(host_reads) == 1
