"""The metric logger: TensorBoard tags, the run's log file, no progress bar off a terminal, wandb only when used."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from conf.checks import UserError
from train.metrics import MetricLogger, read_metrics
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
