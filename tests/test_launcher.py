"""The launchers: the local launcher reports a worker's user error in one line (a crash keeps its report), and the
container entry point wraps training runs in torchrun (c10d rendezvous, restarts, NCCL presets) and passes other
commands through."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from conf.checks import ConfigError, ReportedError
from train.distributed import launch_local_workers


def _worker(failing_ranks: list[int], error: str) -> None:
    """A worker that fails on `failing_ranks` with a user error (`error="user"`) or a crash."""
    rank = int(os.environ["RANK"])
    if rank in failing_ranks:
        if error == "user":
            raise ConfigError("data.path=/nowhere does not exist")
        raise ZeroDivisionError("a bug")


def test_a_user_error_in_workers_is_reported_once_in_one_line():
    with pytest.raises(ReportedError) as info:  # rank 0 is fine; ranks 1 and 2 meet the same error
        launch_local_workers(_worker, 3, [1, 2], "user")
    assert str(info.value) == "config error: data.path=/nowhere does not exist"


def test_a_crash_in_a_worker_keeps_the_launchers_report():
    with pytest.raises(ChildFailedError, match="ZeroDivisionError"):
        launch_local_workers(_worker, 2, [1], "crash")


ENTRYPOINT = Path(__file__).resolve().parents[1] / "docker" / "entrypoint.sh"


def _entrypoint(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """docker/entrypoint.sh with a `python` on PATH that prints its arguments and the NCCL/torch settings."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    fake_python = fake_bin / "python"
    fake_python.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\nenv | grep -E "^(NCCL|TORCH)_" | sort\n')
    fake_python.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_", "SLURM_"))}
    return subprocess.run([str(ENTRYPOINT), *args], env={**base, "PATH": f"{fake_bin}:{os.environ['PATH']}", **env},
                          capture_output=True, text=True, timeout=30)


def test_entrypoint_runs_training_under_torchrun_with_rendezvous_and_restarts(tmp_path):
    result = _entrypoint(tmp_path, "experiment=bert_large_phase1", "name=p1", NPROC_PER_NODE="8", NNODES="4",
                         RDZV_ENDPOINT="node0:29400", RDZV_ID="job7", MAX_RESTARTS="2", NCCL_PRESET="ethernet")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "-m", "torch.distributed.run", "--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node0:29400", "--rdzv-id=job7", "--max-restarts=2", "-m", "train",
        "experiment=bert_large_phase1", "name=p1",
        "NCCL_IB_DISABLE=1", "NCCL_NSOCKS_PERTHREAD=4", "NCCL_PRESET=ethernet", "NCCL_SOCKET_IFNAME=^lo,docker",
        "NCCL_SOCKET_NTHREADS=4",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
    ]


def test_entrypoint_defaults_and_the_infiniband_preset(tmp_path):
    result = _entrypoint(tmp_path, "train", NPROC_PER_NODE="1", NCCL_PRESET="ib", NCCL_IB_HCA="mlx5_0,mlx5_1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2:8] == ["--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29500",
                          "--rdzv-id=train", "--max-restarts=3"]
    assert lines[8:10] == ["-m", "train"]  # `train` itself is not passed on as an override
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in lines  # the caller's setting wins over the preset's
    assert "NCCL_IB_DISABLE=0" in lines


def test_entrypoint_passes_other_commands_through(tmp_path):
    result = _entrypoint(tmp_path, "echo", "python", "-m", "data.prepare", "--help", NCCL_PRESET="bogus")
    assert (result.returncode, result.stdout) == (0, "python -m data.prepare --help\n")


def test_entrypoint_bad_nccl_preset_is_one_line(tmp_path):
    result = _entrypoint(tmp_path, "trainer.max_steps=2", NPROC_PER_NODE="1", NCCL_PRESET="bogus")
    assert result.returncode == 2
    assert result.stderr == "error: NCCL_PRESET=bogus is not one of ib, ethernet, none\n"
