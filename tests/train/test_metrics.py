"""The metric logger: TensorBoard tags, the run's log file, a line per record off a terminal, wandb's id and name."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from helpers.config import TINY
from helpers.runs import run_train
from omegaconf import OmegaConf

from core.errors import UserError
from train.metrics import MetricLogger, read_metrics, record_line, wandb_run_id
from train.run_dir import RunDir


def _logger(run_dir: Path, **options) -> MetricLogger:
    settings = dict(enabled=True, total_steps=10, start_step=0, progress_bar=True, tensorboard=False,
                    wandb_mode="disabled", wandb_project="test", config={})
    return MetricLogger(RunDir(run_dir), **{**settings, **options})


def test_eval_scalars_keep_their_own_prefix_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = _logger(tmp_path, tensorboard=True)
    logger.log({"loss": 1.5}, 1)
    logger.log({"eval/top1": 90.0}, 1)
    logger.close()
    events = EventAccumulator(str(RunDir(tmp_path).tensorboard_dir))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/top1"}
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 1]


def test_info_lines_are_kept_in_the_run_log_and_no_bar_is_drawn_off_a_terminal(tmp_path):
    logger = _logger(tmp_path)  # pytest captures stderr: not a terminal
    assert logger._bar is None
    logger.info("checkpoint step_00000002")
    logger.close()
    assert RunDir(tmp_path).log_file.read_text().rstrip().endswith("checkpoint step_00000002")


def test_wandb_starts_only_with_the_first_record(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = _logger(tmp_path, wandb_mode="offline")
    logger.info("run already complete at step 2; nothing to do")
    logger.close()
    assert not (tmp_path / "wandb").exists()


def test_a_cut_last_record_is_dropped_with_a_warning(tmp_path, caplog):
    path = RunDir(tmp_path).metrics_file
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert "ends in a cut record (line 3), dropped" in caplog.text


def test_a_bad_record_before_the_last_is_one_line_naming_the_file(tmp_path):
    RunDir(tmp_path).metrics_file.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(UserError, match=r"metrics.jsonl line 2 is not a JSON record"):
        read_metrics(tmp_path)


def test_a_tensorboard_write_error_reaches_the_training_thread_alone(tmp_path, monkeypatch):
    from tensorboard.summary.writer.record_writer import RecordWriter

    def unwritable(self, data):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    reported = []
    monkeypatch.setattr(threading, "excepthook", reported.append)  # what would be printed
    logger = _logger(tmp_path, tensorboard=True)
    monkeypatch.setattr(RecordWriter, "write", unwritable)
    with pytest.raises(PermissionError):
        for step in range(1, 1000):  # the writer thread fails on one write, a later one re-raises it
            logger.log({"loss": 1.0}, step)
            time.sleep(0.01)
    with pytest.raises(PermissionError):  # so does closing it
        logger.close()
    assert reported == []
def test_a_batch_job_log_shows_a_loss_line_per_record_and_no_bar(tmp_path):
    result = run_train([*TINY, "trainer.max_steps=3", "logger.progress_bar=true", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ") and "| loss " in line]
    assert [line.split(" |")[0] for line in lines] == [f"step {r['step']}/3" for r in records] == [
        "step 1/3", "step 2/3", "step 3/3"]
    assert all(re.search(r"lr \S+ \| [\d.]+ samples/s \| \d+ tokens/s \| 0 B sent/step \| elapsed \d+:\d\d:\d\d$", line)
               for line in lines)
    assert sum(line in RunDir(tmp_path).log_file.read_text() for line in lines) == 3
    startup = next(line for line in result.stdout.splitlines() if line.startswith("peak lr"))
    assert re.fullmatch(r"peak lr \S+ \(poly_warmup, warm-up 0 of 3 steps\) \| \S+ epochs of data \| seed 42 \| "
                        r"commit (\w{12}|unknown)", startup)
    assert f"steps 1 -> 3: loss {records[0]['loss']:.4g} -> {records[-1]['loss']:.4g}" in result.stdout
    for noise in ("Writing model shards", "it/s]", "leaked semaphore"):
        assert noise not in result.stdout + result.stderr


def test_record_line_reads_in_units():
    record = {"step": 40, "loss": 7.123456, "lr": 1e-3, "seq_per_s": 812.34, "comm_bytes_per_step": 1.5e6,
              "elapsed": 3725.2}
    assert record_line(record, 100) == "step 40/100 | loss 7.1235 | lr 0.001 | 812.3 samples/s | 1.5 MB sent/step | " \
                                       "elapsed 1:02:05"


def test_the_wandb_id_is_drawn_once_per_run_directory_and_kept(tmp_path):
    here, elsewhere = RunDir(tmp_path / "a" / "runs" / "demo"), RunDir(tmp_path / "b" / "runs" / "demo")
    here.path.mkdir(parents=True)
    elsewhere.path.mkdir(parents=True)
    first = wandb_run_id(here)
    assert wandb_run_id(here) == first == here.wandb_id_file.read_text().strip()  # a resume continues it
    assert wandb_run_id(elsewhere) != first  # the same directory name in another checkout: another run
    shutil.rmtree(here.path)
    here.path.mkdir()
    assert wandb_run_id(here) != first  # a fresh run in a removed directory is a new wandb run


def test_wandb_names_a_multirun_job_by_its_overrides(tmp_path, monkeypatch):
    job = RunDir(tmp_path / "demo-multirun" / "1")
    job.overrides_file.parent.mkdir(parents=True)
    job.overrides_file.write_text(OmegaConf.to_yaml(OmegaConf.create(["optim=adamw", "optim.lr=0.001"])))
    assert job.display_name() == "optim=adamw optim.lr=0.001"
    assert RunDir(tmp_path / "demo").display_name() == "demo"
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = _logger(job.path, wandb_mode="offline")
    assert logger._wandb_start["name"] == "optim=adamw optim.lr=0.001"
    assert logger._wandb_start["id"] == job.wandb_id_file.read_text().strip()
    logger.close()
