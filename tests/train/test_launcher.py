"""The launchers: the local launcher reports a worker's user error in one line, and a worker's death in one line
naming it (a crash after its traceback), and the container entry point wraps training runs in torchrun (c10d
rendezvous, restarts, NCCL presets) and passes other commands through."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.config import REPO, TINY, compose

import train.distributed
import train.run
from core.errors import ConfigError, ReportedError
from train.config import launch_world_size
from train.distributed import (
    WorkerDied,
    adopt_slurm_environment,
    init_distributed,
    launch_local_workers,
    launched_externally,
    local_worker_threads,
    pick_device,
)

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                    "SLURM_LOCALID", "SLURM_STEP_ID", "SLURM_STEPID")
# What sbatch's batch shell holds (job-wide values, no step), and what each task of an srun step adds.
SBATCH_SHELL = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "0"}
SRUN_TASK = {**SBATCH_SHELL, "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}


def _worker(failing_ranks: list[int], error: str) -> None:
    """A worker that fails on `failing_ranks` with a user error (`error="user"`), a kill or a crash."""
    rank = int(os.environ["RANK"])
    if rank in failing_ranks:
        if error == "user":
            raise ConfigError("data.path=/nowhere does not exist")
        if error == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ZeroDivisionError("a bug")


def test_a_user_error_in_workers_is_reported_once_in_one_line():
    with pytest.raises(ReportedError) as info:  # rank 0 is fine; ranks 1 and 2 meet the same error
        launch_local_workers(_worker, 3, [1, 2], "user")
    assert str(info.value) == "config error: data.path=/nowhere does not exist"


def test_the_launchers_stop_signal_handlers_are_back_after_the_workers(tmp_path):
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    launch_local_workers(_record_threads, 2, str(tmp_path))
    assert {signum: signal.getsignal(signum) for signum in before} == before  # Ctrl-C is a KeyboardInterrupt again


_STOPPED = ", and the run stopped: rerun the same command to resume from its newest checkpoint"


def test_a_crash_in_a_worker_is_its_traceback_then_one_line(capfd):
    with pytest.raises(WorkerDied) as info:
        launch_local_workers(_worker, 2, [1], "crash")
    assert re.fullmatch(rf"worker rank 1 \(pid \d+\) failed with exit code 1 \(ZeroDivisionError: a bug\){_STOPPED}",
                        str(info.value))
    assert info.value.exit_code == 1  # not a value to change: not 2
    stderr = capfd.readouterr().err  # the worker's traceback, and none of the launcher's report
    assert stderr.startswith("Traceback") and stderr.endswith('("a bug")\nZeroDivisionError: a bug\n')
    assert stderr.count("Traceback") == 1 and "ChildFailedError" not in stderr, stderr


def test_a_killed_worker_is_one_line_naming_its_rank_and_signal(capfd):
    with pytest.raises(WorkerDied) as info:
        launch_local_workers(_worker, 2, [1], "kill")
    assert re.fullmatch(rf"worker rank 1 \(pid \d+\) was killed by SIGKILL \(the kernel's out-of-memory killer sends "
                        rf"it: see dmesg\){_STOPPED}", str(info.value))
    assert capfd.readouterr().err == ""


def _record_threads(out_dir: str) -> None:
    Path(out_dir, os.environ["RANK"]).write_text(str(torch.get_num_threads()))


def test_local_workers_share_the_machines_cores(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train.distributed, "visible_cores", lambda: 8)
    launch_local_workers(_record_threads, 2, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["4", "4"]


def test_the_cores_share_is_at_least_one_thread_and_an_explicit_omp_num_threads_wins():
    assert local_worker_threads(3, {}, 2) == 1
    assert local_worker_threads(2, {"OMP_NUM_THREADS": "3"}, 8) is None


ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


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


SBATCH = ENTRYPOINT.with_name("slurm.sbatch")


def _srun_options(tmp_path: Path, **env: str) -> list[str]:
    """The options docker/slurm.sbatch gives srun, with `srun` and `scontrol` on PATH replaced by echoes."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    for name, body in (("srun", 'for a in "$@"; do echo "$a"; done'), ("scontrol", "echo node0")):
        (fake_bin / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake_bin / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    job = {"IMAGE": "img.sqsh", "DATA_DIR": "/d", "RUNS_DIR": "/r", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "64"}
    result = subprocess.run(["bash", str(SBATCH), "name=p1"], env={**base, **job, **env,
                            "PATH": f"{fake_bin}:{os.environ['PATH']}"}, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line.startswith("--cpus-per-task")]


def test_sbatch_passes_the_jobs_cpus_to_srun_explicitly(tmp_path):
    # Slurm >= 22.05: srun does not read the job's --cpus-per-task; the script must say it.
    assert _srun_options(tmp_path, SLURM_CPUS_PER_TASK="16") == ["--cpus-per-task=16"]
    assert _srun_options(tmp_path) == ["--cpus-per-task=64"]  # no --cpus-per-task on the job: the whole node

@pytest.fixture
def launch_env(monkeypatch):
    """Clear the launchers' variables; returns a function that sets some (as torchrun or SLURM would). Each is
    set before it is cleared, so that what the code under test writes into the environment is undone too."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)

    def set_env(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine sees `n` CUDA devices."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


@pytest.fixture
def started(monkeypatch) -> list[str]:
    """How run() started training ("local workers" or "this process"), with the real starters replaced."""
    calls: list[str] = []
    monkeypatch.setattr(train.run, "launch_local_workers", lambda *args: calls.append("local workers"))
    monkeypatch.setattr(train.run, "train_worker", lambda *args: calls.append("this process"))
    return calls


def test_a_task_bound_to_one_gpu_uses_it_whatever_its_local_rank(launch_env, gpus):
    gpus(1)  # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds this task's GPU alone
    launch_env(LOCAL_RANK="5")
    assert pick_device("cuda") == torch.device("cuda", 0)


def test_workers_of_a_node_take_the_gpu_of_their_local_rank(launch_env, gpus):
    gpus(8)
    launch_env(LOCAL_RANK="5")
    assert pick_device("auto") == torch.device("cuda", 5)


def test_a_local_rank_beyond_the_visible_gpus_is_a_user_error(launch_env, gpus):
    gpus(2)
    launch_env(LOCAL_RANK="3")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=3 but this process sees only 2 CUDA devices.*"
                                          r"trainer\.nproc_per_node"):
        pick_device("cuda")


def test_more_local_workers_than_gpus_is_refused_before_any_starts(launch_env, gpus, started, tmp_path):
    gpus(2)
    with pytest.raises(ConfigError, match=r"trainer\.nproc_per_node=4 workers, one per GPU, but this node has 2"):
        train.run.run(compose([*TINY, "trainer.device=cuda", "trainer.global_batch_size=16",
                               "trainer.nproc_per_node=4"]), tmp_path)
    assert started == []


def test_a_plain_run_in_an_sbatch_script_starts_its_own_workers(launch_env, started, tmp_path):
    launch_env(**SBATCH_SHELL)  # `python -m train trainer.nproc_per_node=2` in the batch script, outside srun
    assert not launched_externally()
    cfg = compose([*TINY, "trainer.nproc_per_node=2"])
    assert launch_world_size(cfg) == 2  # not the job's SLURM_NTASKS=16
    train.run.run(cfg, tmp_path)
    assert started == ["local workers"]
    adopt_slurm_environment()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


# What the launcher of local workers checks and records, in a fresh interpreter: it never builds a model.
_LAUNCHER_ONLY = """
import sys
from helpers.config import TINY, compose
import train.run
train.run.launch_local_workers = lambda *args: print("local workers")
train.run.run(compose([*TINY, "trainer.nproc_per_node=2"]), sys.argv[1])
print(sorted(m for m in ("transformers.modeling_utils", "torch._dynamo", "timm") if m in sys.modules))
"""


def test_the_launcher_checks_a_run_without_importing_the_modeling_stack(tmp_path):
    """Each local worker imports transformers' modeling stack itself; the launcher before them would pay those
    seconds for nothing (on every `python -m train trainer.nproc_per_node=N`)."""
    result = subprocess.run([sys.executable, "-c", _LAUNCHER_ONLY, str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["local workers", "[]"]
    assert (tmp_path / ".hydra" / "config.yaml").is_file()  # the run was accepted and recorded


@pytest.mark.parametrize("step_variable", ["SLURM_STEP_ID", "SLURM_STEPID"])  # the second: Slurm before 20.11
def test_an_srun_task_joins_the_world_srun_describes(launch_env, started, tmp_path, step_variable):
    task = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"}
    launch_env(**task, **{step_variable: "0"}, MASTER_ADDR="node0", MASTER_PORT="29500")
    assert launched_externally() and launch_world_size(compose(TINY)) == 16
    adopt_slurm_environment()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "16", "3")


def test_nproc_per_node_under_a_launcher_is_refused_not_ignored(launch_env, started, tmp_path):
    launch_env(**SRUN_TASK)
    with pytest.raises(ConfigError, match=r"trainer\.nproc_per_node=8, but this process was started by srun"):
        train.run.run(compose([*TINY, "trainer.global_batch_size=64", "trainer.nproc_per_node=8"]), tmp_path)
    launch_env(RANK="0", WORLD_SIZE="2")
    with pytest.raises(ConfigError, match=r"started by torchrun"):
        train.run.run(compose([*TINY, "trainer.nproc_per_node=2"]), tmp_path)
    assert started == []


@pytest.mark.parametrize(("device", "bound"), [("cuda:1", torch.device("cuda", 1)), ("cpu", None)])
def test_the_process_group_is_bound_to_the_workers_gpu(launch_env, monkeypatch, device, bound):
    """With its device given, NCCL's barriers use that GPU instead of guessing one (and warning); gloo as before."""
    joined = {}
    monkeypatch.setattr(train.distributed.dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    launch_env(RANK="1", WORLD_SIZE="2")
    init_distributed("auto", torch.device(device))
    assert joined["backend"] == ("nccl" if bound else "gloo") and joined.get("device_id") == bound


@pytest.mark.slow
def test_under_torchrun_only_rank_zero_writes_the_run_directorys_log(tmp_path):
    """Every torchrun worker runs Hydra in the same run directory: only rank 0's lines may reach a log there
    (Hydra's own file log is off, conf/config.yaml; the run's train.log is rank 0's)."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "train", *TINY,
         "trainer.max_steps=2", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*.log")) == ["train.log"]
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["choices.yaml", "config.yaml", "overrides.yaml"]
    lines = [line.split(" ", 2)[2] for line in (run_dir / "train.log").read_text().splitlines()]
    assert len(lines) == len(set(lines))  # no line twice: one writer
    assert sum(line.startswith("run dir ") for line in lines) == 1
    assert "2 rank(s)" in next(line for line in lines if line.startswith("run dir "))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_every_local_rank_gets_a_device_that_exists(launch_env):
    count = torch.cuda.device_count()
    launch_env(LOCAL_RANK="5" if count == 1 else str(count - 1))  # one visible GPU: any local rank uses it
    device = pick_device("cuda")
    assert torch.ones(1, device=device).device == device


def _worker_pids(launcher: int) -> list[int]:
    """The local workers a `python -m train` process started (spawned children, not the resource tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == launcher and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_one_line_and_the_runs_record(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "train", *TINY, "trainer.nproc_per_node=2", "trainer.micro_batch_size=2",
         "trainer.max_steps=100000", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (tmp_path / "metrics.jsonl").is_file() or not (tmp_path / "metrics.jsonl").read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()[-3000:]
        time.sleep(0.1)
    killed = _worker_pids(launcher.pid)[-1]
    os.kill(killed, signal.SIGKILL)  # as the kernel's out-of-memory killer does
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 1
    [line] = stderr.strip().splitlines()
    assert re.fullmatch(rf"error: worker rank \d \(pid {killed}\) was killed by SIGKILL \(.*\){_STOPPED}", line)
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == line.removeprefix("error: ")
    assert f"stopped: {line.removeprefix('error: ')}" in (tmp_path / "train.log").read_text()
    assert not (tmp_path / "run.lock").exists()
