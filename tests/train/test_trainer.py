"""The trainer end to end on a tiny BERT: learning, accumulation, precision, exact resume, signals, DDP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.config import NO_DROPOUT, REPO, TINY, compose
from helpers.distributed_harness import run_on_ranks
from helpers.runs import popen_train, run_train, wait_for_step
from transformers import AutoTokenizer, BertForPreTraining

import train.checkpoint
import train.metrics
from core.errors import ConfigError
from data.loader import ResumableLoader
from data.text.shards import ShardError
from optim.comm import Comm
from train.checkpoint import Checkpointer
from train.metrics import read_metrics
from train.plan import plan_run
from train.precision import set_matmul_precision
from train.run import run
from train.stop import RunStopped


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    run(compose([*TINY, *overrides]), tmp_path)
    return read_metrics(tmp_path)


def test_run_trains_checkpoints_and_exports(tmp_path):
    records = _train(tmp_path, "trainer.max_steps=8", "trainer.keep_last=2")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(r["comm_bytes_per_step"] == 0 for r in records)  # one process sends nothing
    for key in ("loss", "mlm_loss", "nsp_loss", "lr", "grad_norm", "seq_per_s", "comm_bits_per_param"):
        assert key in records[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]
    exported = BertForPreTraining.from_pretrained(tmp_path / "hf_model")
    assert exported.config.vocab_size == 30528
    assert len(AutoTokenizer.from_pretrained(tmp_path / "hf_model")) == 30522


@pytest.fixture(scope="module")
def _finished_two_step_run(tmp_path_factory) -> Path:
    """One finished `trainer.max_steps=2` run: the tests that start from one get a copy (cheaper than training)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    _train(run_dir, "trainer.max_steps=2")
    return run_dir


@pytest.fixture
def finished_run(_finished_two_step_run, tmp_path) -> Path:
    """A private copy (timestamps included) of the finished 2-step run, as `_train(tmp_path, "trainer.max_steps=2")`
    would leave it."""
    shutil.copytree(_finished_two_step_run, tmp_path, dirs_exist_ok=True)
    return tmp_path


def test_rerunning_a_finished_run_does_nothing(finished_run):
    tmp_path = finished_run
    stamp = (tmp_path / "checkpoints" / "step_00000002" / "shared.pt").stat().st_mtime_ns
    _train(tmp_path, "trainer.max_steps=2")
    assert (tmp_path / "checkpoints" / "step_00000002" / "shared.pt").stat().st_mtime_ns == stamp


def test_a_run_whose_metrics_end_in_a_cut_record_resumes(finished_run):
    with open(finished_run / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 3, "loss": 9')  # as a crash mid-write leaves it
    assert [r["step"] for r in _train(finished_run, "trainer.max_steps=4")] == [1, 2, 3, 4]


def test_resume_false_refuses_to_overwrite(finished_run):
    tmp_path = finished_run
    with pytest.raises(RuntimeError, match="already has checkpoint"):
        _train(tmp_path, "trainer.max_steps=4", "trainer.resume=false")


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    accumulated = _train(tmp_path / "a", *NO_DROPOUT, "trainer.max_steps=3", "trainer.micro_batch_size=2")
    single = _train(tmp_path / "b", *NO_DROPOUT, "trainer.max_steps=3", "trainer.micro_batch_size=8")
    for a, b in zip(accumulated, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_schedule_sets_lr_per_optimizer_step(tmp_path):
    records = _train(tmp_path, "trainer.max_steps=10", "schedule.kwargs.warmup_fraction=0.5", "optim.lr=0.01")
    lrs = [r["lr"] for r in records]
    assert lrs[0] == pytest.approx(0.01 * 0.1 / 0.5)  # progress 1/10 of a 0.5 warm-up
    assert max(lrs) == pytest.approx(lrs[3]) == pytest.approx(0.01 * 0.4 / 0.5)  # last warm-up step
    # NVIDIA's PolyWarmUpScheduler then jumps to peak * (1 - progress) ** 0.5 and decays.
    assert lrs[4] == pytest.approx(0.01 * 0.5**0.5)
    assert lrs == sorted(lrs[:4]) + sorted(lrs[4:], reverse=True)


@pytest.mark.slow
def test_a_compiled_ddp_run_trains_the_eager_runs_series(tmp_path):
    # Two local workers (DDP around the copy whose layers are compiled). Without dropout (a compiled graph draws its
    # own random numbers) the series agree to float rounding.
    series = []
    for name, compile in (("eager", "false"), ("compiled", "true")):
        result = run_train([*TINY, *NO_DROPOUT, "trainer.nproc_per_node=2", "trainer.micro_batch_size=2",
                            "trainer.max_steps=3", f"trainer.compile={compile}", f"hydra.run.dir={tmp_path / name}"])
        assert result.returncode == 0, result.stderr[-3000:]
        series.append(read_metrics(tmp_path / name))
    eager, compiled = series
    assert len(compiled) == 3
    for ours, reference in zip(compiled, eager, strict=True):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(tmp_path, precision):
    records = _train(tmp_path, f"precision={precision}", "trainer.max_steps=3")
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert ("loss_scale" in records[-1]) == (precision == "fp16")


def test_tf32_is_fp32_with_tf32_matmuls(tmp_path, _finished_two_step_run):
    fp32 = read_metrics(_finished_two_step_run)  # the fp32 run of `_train(..., "trainer.max_steps=2")`
    try:
        tf32 = _train(tmp_path / "tf32", "precision=tf32", "trainer.max_steps=2")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        set_matmul_precision("fp32")
    assert [r["loss"] for r in tf32] == [r["loss"] for r in fp32]  # on CPU, TF32 changes nothing


def test_non_finite_loss_stops_without_saving_with_a_record_and_one_line(tmp_path):
    result = run_train([*TINY, "optim=adamw", "optim.lr=1e30", "trainer.grad_clip=0", "trainer.checkpoint_every=1",
                        f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith("error: non-finite loss at step ") and "\n" not in line, line
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped"] == line.removeprefix("error: ") and not summary["finished"]
    assert f"stopped at step {summary['steps']}: non-finite loss" in (tmp_path / "train.log").read_text()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    for name in saved:
        state = torch.load(tmp_path / "checkpoints" / name / "shared.pt", weights_only=False)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


@pytest.mark.slow
def test_sigkill_then_resume_repeats_the_loss_series_exactly(tmp_path):
    args = [*TINY, "trainer.max_steps=14", "trainer.checkpoint_every=3", "data.masking=dynamic"]
    reference = run_train([*args, f"hydra.run.dir={tmp_path / 'ref'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    proc = popen_train([*args, f"hydra.run.dir={killed_dir}"])
    wait_for_step(killed_dir, 8, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train([*args, f"hydra.run.dir={killed_dir}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    def series(run_dir):
        return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)]

    assert series(killed_dir) == series(tmp_path / "ref")  # bit-identical floats, every step once
    assert len(series(killed_dir)) == 14


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path, stop_signal):
    proc = popen_train([*TINY, "trainer.max_steps=100000", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"])
    wait_for_step(tmp_path, 3, proc)
    proc.send_signal(stop_signal)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    last_logged = read_metrics(tmp_path)[-1]["step"]
    assert (tmp_path / "checkpoints" / f"step_{last_logged:08d}" / "shared.pt").exists()
    assert not (tmp_path / "hf_model").exists()  # not finished, so not exported
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == stop_signal.name


# 4 micro-batches per step; the stop request comes inside step 4 (before its third micro-batch), with dropout and
# dynamic masking on, so a resume that replayed any data or random draw of the abandoned step would diverge.
_ACCUMULATING = [*TINY, "trainer.micro_batch_size=2", "trainer.checkpoint_every=0", "data.masking=dynamic"]
_SIGNAL_AT_BATCH = 3 * 4 + 3


def _signal_at_batch(monkeypatch, batch: int) -> None:
    """SIGTERM this process when the loader hands out its `batch`-th micro-batch (1-based)."""
    handed_out = []
    original = ResumableLoader.__next__

    def next_batch(self):
        handed_out.append(1)
        if len(handed_out) == batch:
            signal.raise_signal(signal.SIGTERM)
        return original(self)

    monkeypatch.setattr(ResumableLoader, "__next__", next_batch)


def _series(run_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


def test_a_stop_inside_an_accumulation_saves_the_last_step_and_resumes_exactly(tmp_path, monkeypatch):
    _train(tmp_path / "ref", *_ACCUMULATING)
    with monkeypatch.context() as patch:
        _signal_at_batch(patch, _SIGNAL_AT_BATCH)
        _train(tmp_path / "stopped", *_ACCUMULATING)
    checkpoints = sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir())
    assert checkpoints == ["step_00000003"]  # the last completed step, not the abandoned one
    shared = torch.load(tmp_path / "stopped" / "checkpoints" / "step_00000003" / "rank_00000.pt", weights_only=False)
    assert shared["data"]["index"] == 3 * 8  # the abandoned step's micro-batches are not counted as consumed
    _train(tmp_path / "stopped", *_ACCUMULATING)
    assert _series(tmp_path / "stopped") == _series(tmp_path / "ref")  # bit-identical floats, every step once


def _stop_on_one_rank_then_resume(rank: int, world_size: int, tmp_path: Path) -> list[int]:
    """Uninterrupted, stopped (rank 0 alone signalled, inside step 4 again) and resumed runs, in one process."""
    from optim.comm import Comm
    from train.trainer import Trainer

    def train(run_dir: Path, signal_at_batch: int | None = None) -> int:
        with pytest.MonkeyPatch.context() as patch:
            if signal_at_batch is not None and rank == 0:
                _signal_at_batch(patch, signal_at_batch)
            cfg = compose([*_ACCUMULATING, "trainer.micro_batch_size=1", f"trainer.nproc_per_node={world_size}"])
            trainer = Trainer(plan_run(cfg, run_dir), Comm())
            trainer.fit()
            trainer.close()
        return trainer.step

    return [train(tmp_path / "ref"), train(tmp_path / "stopped", _SIGNAL_AT_BATCH - 1), train(tmp_path / "stopped")]


@pytest.mark.slow
def test_ranks_agree_on_a_stop_inside_an_accumulation_and_resume_exactly(tmp_path):
    # Both ranks leave the same micro-batch (a rank left in the step's gradient all-reduce would hang), one
    # boundary later than a single process would, so still inside step 4.
    assert run_on_ranks(_stop_on_one_rank_then_resume, 2, tmp_path) == [[6, 3, 6]] * 2
    assert _series(tmp_path / "stopped") == _series(tmp_path / "ref")


@pytest.mark.slow
def test_two_local_workers_log_communicated_bytes(tmp_path):
    # global 8 = micro 2 x 2 ranks x 2 accumulation steps: the all-reduce must run once per step.
    result = run_train([*TINY, "trainer.nproc_per_node=2", "trainer.micro_batch_size=2", "trainer.max_steps=4",
                        f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    shared = torch.load(tmp_path / "checkpoints" / "step_00000004" / "shared.pt", weights_only=False)
    assert shared["world_size"] == 2
    assert (tmp_path / "checkpoints" / "step_00000004" / "rank_00001.pt").exists()
    for record in records:
        # Every fp32 gradient goes out exactly once per step: 32 bits per parameter, not 64.
        assert record["comm_bytes_per_step"] > 0
        assert record["comm_bits_per_param"] == pytest.approx(32.0)


@pytest.mark.slow
def test_srun_environment_runs_unchanged(tmp_path):
    """Two processes started the way srun starts them (SLURM_* variables only) form one run."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "SLURM_PROCID": str(rank),
               "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "train", *TINY, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path)[-1]["comm_bits_per_param"] == pytest.approx(32.0)
    assert (tmp_path / "checkpoints" / "step_00000002" / "rank_00001.pt").exists()


def test_non_finite_weights_are_never_checkpointed_between_log_records(tmp_path):
    with pytest.raises(RunStopped, match="non-finite weights at step") as info:
        _train(tmp_path, "optim=adamw", "optim.lr=1e30", "trainer.grad_clip=0", "trainer.log_every=10",
               "trainer.checkpoint_every=1")
    assert "None" not in str(info.value)
    for checkpoint in (tmp_path / "checkpoints").glob("step_*"):
        state = torch.load(checkpoint / "shared.pt", weights_only=False)
        assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_rerun_after_a_crash_past_the_last_checkpoint_finishes_the_export(finished_run):
    tmp_path = finished_run
    shutil.rmtree(tmp_path / "hf_model")  # as if killed between the final checkpoint and the export
    (tmp_path / "finished.json").unlink()
    _train(tmp_path, "trainer.max_steps=2")
    assert BertForPreTraining.from_pretrained(tmp_path / "hf_model") is not None
    assert (tmp_path / "finished.json").is_file()


def test_refused_runs_leave_the_recorded_config_alone(tmp_path):
    run(compose([*TINY, "trainer.max_steps=2"]), tmp_path, overrides=["trainer.max_steps=2"])
    recorded = (tmp_path / ".hydra" / "config.yaml").read_bytes()
    assert b"max_steps: 2" in recorded
    with pytest.raises(ConfigError, match=r"optim\.name=adamw: .* was trained with optim=lamb"):
        run(compose([*TINY, "trainer.max_steps=4", "optim=adamw"]), tmp_path, overrides=["optim=adamw"])
    with pytest.raises(ConfigError, match="already has checkpoint"):
        run(compose([*TINY, "trainer.max_steps=4", "trainer.resume=false"]), tmp_path, overrides=[])
    with pytest.raises(ConfigError, match=r"^model\.hidden_size=64: .* holds checkpoints of a model with "
                                          r"model\.hidden_size=32 "):
        run(compose([*TINY, "trainer.max_steps=4", "model.hidden_size=64"]), tmp_path, overrides=[])
    with pytest.raises(ConfigError, match=r"^trainer\.seed=7: .* was trained with trainer\.seed=42 \(checkpoint "
                                          r"step_00000002\), whose data order .*; resume with trainer\.seed=42"):
        run(compose([*TINY, "trainer.max_steps=4", "trainer.seed=7"]), tmp_path, overrides=[])
    assert (tmp_path / ".hydra" / "config.yaml").read_bytes() == recorded
    assert (tmp_path / ".hydra" / "overrides.yaml").read_text().strip() == "- trainer.max_steps=2"


def test_a_refused_model_names_the_values_in_use_not_the_nulls(finished_run):
    with pytest.raises(ConfigError, match=r"^model\.num_hidden_layers=2: .* with model\.num_hidden_layers=1 "):
        run(compose([*TINY, "trainer.max_steps=4", "model.num_hidden_layers=null"]), finished_run)


def test_surprising_settings_are_said_once_at_start_up(tmp_path, capsys):
    _train(tmp_path, "precision=fp16", "optim=onebit_lamb", "trainer.max_steps=2")
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert sum("warning: precision=fp16 on CPU" in line for line in lines) == 1
    assert sum("warning: optim.freeze_step=100000 is not below the run's 2 steps" in line for line in lines) == 1


@pytest.mark.slow
def test_sigterm_to_the_local_launcher_stops_every_worker_with_a_checkpoint(tmp_path):
    proc = popen_train([*TINY, "trainer.nproc_per_node=2", "trainer.micro_batch_size=2", "trainer.max_steps=100000",
                        "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"])
    wait_for_step(tmp_path, 3, proc)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "leaked semaphore" not in stderr  # the workers leave with os._exit: nothing multiprocessing is left open
    assert time.monotonic() - signalled < 20  # promptly: not after the launcher's 30 s kill timeout
    last_logged = read_metrics(tmp_path)[-1]["step"]
    assert (tmp_path / "checkpoints" / f"step_{last_logged:08d}" / "rank_00001.pt").exists()


def test_init_from_weights_of_another_model_is_one_line_before_anything_is_recorded(tmp_path):
    other = Checkpointer(tmp_path / "swin" / "checkpoints", keep_last=1, comm=Comm())
    other.save(2, {"model": {"layers.0.blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, {})
    result = run_train([*TINY, f"trainer.init_from={tmp_path / 'swin'}", f"hydra.run.dir={tmp_path / 'bert'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"config error: trainer.init_from={tmp_path / 'swin'}: none of its weights match the model's parameter names "
        "(a run of another model?)"
    ]
    assert not (tmp_path / "bert").exists()  # Hydra made it for this run; refused, the run leaves nothing behind


def test_a_full_disk_mid_checkpoint_is_one_line_that_keeps_the_previous_checkpoints(tmp_path, monkeypatch):
    real_save = train.checkpoint.atomic_torch_save

    def disk_full_at_step_4(obj, path):
        if path.parent.name == "step_00000004.tmp" and path.name == "shared.pt":  # after this rank's own file
            with open("/dev/full", "wb") as full:  # torch.save's own report of ENOSPC: RuntimeError("unexpected pos")
                torch.save(obj, full)
        real_save(obj, path)

    monkeypatch.setattr(train.checkpoint, "atomic_torch_save", disk_full_at_step_4)
    with pytest.raises(RunStopped) as info:
        _train(tmp_path)
    line = str(info.value)
    checkpoints = tmp_path / "checkpoints"
    assert line == (f"no space left on device writing {checkpoints}: free some space, then rerun to resume from the "
                    f"newest checkpoint, {checkpoints / 'step_00000002'}")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained tracebacks
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002"]  # no step_00000004.tmp
    assert Checkpointer(checkpoints, keep_last=1, comm=Comm()).load(checkpoints / "step_00000002")[0]["step"] == 2
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == line
    assert f"stopped at step 4: {line}" in (tmp_path / "train.log").read_text()


def test_a_full_disk_under_the_metrics_file_is_one_line_naming_it(tmp_path, monkeypatch):
    def open_full(path, *args, **kwargs):  # the metrics file on a full disk: its writes name no file
        return open("/dev/full" if Path(path).name == "metrics.jsonl" else path, *args, **kwargs)

    monkeypatch.setattr(train.metrics, "open", open_full, raising=False)
    with pytest.raises(RunStopped) as info:
        _train(tmp_path)
    assert str(info.value) == (f"no space left on device writing {tmp_path / 'metrics.jsonl'}: free some space, then "
                               "rerun to start over (no checkpoint was written before)")


def _fail_after_steps(monkeypatch, steps: int, error: Exception) -> None:
    """The loader raises `error` once it has handed out `steps` steps' micro-batches (2 per step in these runs)."""
    handed_out = []
    original = ResumableLoader.__next__

    def failing(self):
        handed_out.append(1)
        if len(handed_out) > steps * 2:
            raise error
        return original(self)

    monkeypatch.setattr(ResumableLoader, "__next__", failing)


def test_a_data_error_mid_run_stops_with_a_record(tmp_path, monkeypatch):
    _fail_after_steps(monkeypatch, 3, ShardError("shard-00003.parquet fails its checksum: prepare the data again"))
    with pytest.raises(ShardError):
        _train(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["stopped"]) == (3, "shard-00003.parquet fails its checksum: prepare the data "
                                                         "again")
    assert "stopped at step 3: shard-00003.parquet fails its checksum" in (tmp_path / "train.log").read_text()


def test_an_fp16_run_whose_loss_scale_collapses_stops_in_one_line_with_a_record(tmp_path):
    # LR 1e6: after step 1 every step overflows, at every scale; the run used to skip steps without end and silently.
    with pytest.raises(RunStopped) as info:
        _train(tmp_path, "precision=fp16", "optim.lr=1e6", "trainer.max_steps=50")
    line = str(info.value)
    assert line.startswith("loss scale collapsed: the 20 fp16 steps after step 1 all overflowed (precision."
                           "max_consecutive_skips=20; the loss scale fell to ") and "\n" not in line
    assert line.endswith("rerun to start over (no checkpoint was written before), with a lower optim.lr, or "
                         "precision=bf16 (no loss scale)")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["finished"], summary["stopped"]) == (1, False, line)
    assert f"stopped at step 1: {line}" in (tmp_path / "train.log").read_text()


def test_the_overflow_limit_lets_the_loss_scale_fall_to_one():
    with pytest.raises(ConfigError, match=r"^precision\.max_consecutive_skips=20 would stop the run before its loss "
                                          r"scale fell from precision\.init_scale=1\.09951e\+12 to 1 \(each overflow "
                                          r"halves it\): set it to at least 40$"):
        plan_run(compose([*TINY, "precision=fp16", "precision.init_scale=1099511627776.0"]), "unused")


def test_out_of_memory_stops_in_one_line_naming_the_micro_batch_to_lower(tmp_path, monkeypatch):
    _fail_after_steps(monkeypatch, 2, torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB of which 1.2 GiB is "
        "free.\nIf reserved but unallocated ..."))
    with pytest.raises(RunStopped) as info:
        _train(tmp_path)
    assert str(info.value) == (
        "out of memory on cpu at step 3 (tried to allocate 2.00 GiB): lower trainer.micro_batch_size from 4 per rank "
        "(the accumulation steps grow to keep trainer.global_batch_size=8), then rerun to resume from the newest "
        f"checkpoint, {tmp_path / 'checkpoints' / 'step_00000002'}")
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == str(info.value)


def test_steps_this_run_stops_with_a_line_and_a_record_and_a_rerun_continues(tmp_path, capsys):
    _train(tmp_path, "trainer.steps_this_run=2")
    line = "trainer.steps_this_run=2: stopping at step 2 of 6 with a checkpoint; rerun the same command to continue"
    assert line in capsys.readouterr().out and line in (tmp_path / "train.log").read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["finished"], summary["stopped"]) == (2, False, "trainer.steps_this_run=2")
    assert [r["step"] for r in _train(tmp_path, "trainer.steps_this_run=10")] == [1, 2, 3, 4, 5, 6]
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] is None


def test_a_resume_with_another_max_steps_says_how_the_lr_changes(finished_run, capsys):
    _train(finished_run, "trainer.max_steps=4")  # warm-up 10 %: step 3 of 2 is past the end, of 4 in the decay
    peak = compose(TINY).optim.lr
    line = f"trainer.max_steps 2 -> 4: the LR schedule is re-derived; the LR at step 3 goes from 0 to {peak * 0.5:.4g}"
    assert line in capsys.readouterr().out and line in (finished_run / "train.log").read_text()


def test_a_refused_run_removes_the_directory_it_made(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.lr"):
        run(compose([*TINY, "optim.lr=-1"]), tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_the_closing_line_compares_the_first_and_last_records_never_one_with_itself():
    from train.trainer import _closing_line

    first, last = {"step": 1, "loss": 11.02, "mlm_loss": 10.3, "lr": 1.0}, {"step": 4, "loss": 10.89, "mlm_loss": 10.2}
    assert _closing_line([first, {"step": 2, "loss": 12.0}, last]) == (
        "steps 1 -> 4: loss 11.02 -> 10.89, mlm_loss 10.3 -> 10.2")
    assert _closing_line([last]) == "one training record (step 4): loss 10.89, mlm_loss 10.2"
    assert _closing_line([]) == "no training record was logged"
