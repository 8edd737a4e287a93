"""Elastic restart on CPU: a torchrun gloo job whose worker is SIGKILLed mid-run restarts (`--max-restarts 1`),
resumes from the last checkpoint and logs the loss series of an uninterrupted run.

As docker/entrypoint.sh does, the agents run with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: when the workers share
the rendezvous store, a restarted gloo rank reads its peer's address from the failed attempt and cannot connect.

The fault is injected by this file itself, run by torchrun as the worker script: on the first attempt, rank 1
kills itself when its loader hands out the `KILL_AT_BATCH` micro-batch, so nothing in the product knows of it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.config import REPO, TINY

KILL_AT_BATCH = "TEST_ELASTIC_KILL_AT_BATCH"  # env: the 1-based micro-batch at which rank 1 dies on attempt 0


def _die_at_batch(batch: int) -> None:
    """SIGKILL this process when the loader hands out its `batch`-th micro-batch: no handler, no checkpoint."""
    from data.loader import ResumableLoader

    handed_out = []
    original = ResumableLoader.__next__

    def next_batch(self):
        handed_out.append(1)
        if len(handed_out) == batch:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    ResumableLoader.__next__ = next_batch


def _torchrun(run_dir: Path, *overrides: str, kill_at_batch: int | None = None) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # tests/ too: this file is the worker script, and imports the helpers
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop(KILL_AT_BATCH, None)
    if kill_at_batch is not None:
        env[KILL_AT_BATCH] = str(kill_at_batch)
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
               "--monitor-interval=0.2", __file__, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _series(run_dir: Path) -> list[tuple]:
    from train.metrics import read_metrics

    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_resumes_the_uninterrupted_loss_series(tmp_path):
    # One micro-batch per step and rank: the worker dies inside step 8, two steps after the checkpoint of step 6.
    args = [*TINY, "trainer.max_steps=10", "trainer.checkpoint_every=3", "data.masking=dynamic"]
    reference = _torchrun(tmp_path / "reference", *args)
    assert reference.returncode == 0, reference.stderr[-3000:]

    restarted = _torchrun(tmp_path / "restarted", *args, kill_at_batch=8)
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    logs = restarted.stdout + restarted.stderr
    assert "failed (exitcode: -9) local_rank: 1" in logs  # the agent saw rank 1 killed, and restarted the workers
    assert f"resumed from {tmp_path / 'restarted' / 'checkpoints' / 'step_00000006'} at step 6" in logs

    assert _series(tmp_path / "restarted") == _series(tmp_path / "reference")  # bit-identical, every step once
    assert [step for step, *_ in _series(tmp_path / "restarted")] == list(range(1, 11))


if __name__ == "__main__":  # a torchrun worker: `python -m train` with the fault armed on the first attempt
    if os.environ.get(KILL_AT_BATCH) and os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        _die_at_batch(int(os.environ[KILL_AT_BATCH]))
    from train.__main__ import accept_appended_experiment, main

    sys.argv = accept_appended_experiment(sys.argv)
    main()
