"""`python -m train.evaluate`: the task's evaluation of a checkpoint or an export, the same as the run's own, written
where RunDir says."""

from __future__ import annotations

import json

import pytest
from helpers.models import TINY_BERT
from helpers.runs import run_module

from core.errors import ConfigError, UserError
from models import create_model, quiet_transformers
from train.evaluate import evaluate
from train.metrics import read_metrics
from train.restore import find_weights, weights_config
from train.run_dir import RunDir


def test_a_checkpoint_evaluates_as_the_run_evaluated_it(swin_digits_run):
    result = run_module("train.evaluate", swin_digits_run / "checkpoints" / "step_00000004")
    assert result.returncode == 0, result.stderr
    written = json.loads(RunDir(swin_digits_run).eval_file.read_text())
    logged = next(r for r in read_metrics(swin_digits_run) if r["step"] == 4 and "eval/top1" in r)
    assert written["metrics"]["eval/top1"] == logged["eval/top1"]
    assert written["weights"].endswith("step_00000004")


def test_an_export_outside_its_run_evaluates_with_the_config_it_is_given(swin_digits_run, tmp_path):
    recorded = RunDir(swin_digits_run).recorded_config()
    (tmp_path / "export").symlink_to(RunDir(swin_digits_run).export_dir)
    result = run_module("train.evaluate", tmp_path / "export", "experiment=swin_demo",
                        f"data.path={recorded.data.path}", "trainer.device=cpu", "data.eval_batch_size=180", "--out",
                        tmp_path / "eval")
    assert result.returncode == 0, result.stderr
    assert "eval/top1" in json.loads(RunDir(tmp_path / "eval").eval_file.read_text())["metrics"]
    refused = run_module("train.evaluate", tmp_path / "export", "experiment=swin_demo")
    assert refused.returncode == 2 and "give --out DIR" in refused.stderr


@pytest.mark.parametrize(("override", "message"), [
    ("data.eval_batch_sise=8", "data.eval_batch_sise is not a key of the config {run} recorded; did you mean "
                               "data.eval_batch_size?"),
    ("trainer.nope=1", "trainer.nope is not a key of the config {run} recorded"),
    ("+trainer.nope=1", "+trainer.nope=1: give key=value, to change a key of the config {run} recorded"),
    ("model=swin_base", "model=swin_base: model is a group of the config {run} recorded, which keeps the choice it was "
                        "trained with; change its keys (model.<key>=...)"),
])
def test_an_override_the_recorded_config_cannot_take_is_refused_naming_it(swin_digits_run, override, message):
    with pytest.raises(ConfigError) as info:
        weights_config(find_weights(swin_digits_run), [override])
    assert str(info.value) == message.format(run=swin_digits_run)


def test_the_command_refuses_an_unknown_key_in_one_line(swin_digits_run):
    result = run_module("train.evaluate", swin_digits_run, "data.eval_batch_sise=8")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"config error: data.eval_batch_sise is not a key of the config {swin_digits_run} recorded; did you mean "
        "data.eval_batch_size?"]


def test_an_export_without_the_task_head_is_refused_naming_it(tmp_path):
    with quiet_transformers():
        create_model("bert_pretraining", **TINY_BERT).save_pretrained(tmp_path / "pretrained")
    question_answering = ["experiment=squad_demo", "model.config_from=null", "data.vocab_path=null",
                          *[f"model.{key}={value}" for key, value in TINY_BERT.items()]]
    with pytest.raises(UserError) as info:
        evaluate(tmp_path / "pretrained", question_answering, out=tmp_path / "eval")
    assert str(info.value) == (
        f"{tmp_path / 'pretrained'} does not hold the whole model (21 of 23 tensors load; starting fresh: qa_outputs "
        "(2); not used: bert.pooler (2), cls.predictions (5), cls.seq_relationship (2)): evaluate weights trained for "
        "task question_answering")
    assert not (tmp_path / "eval").exists()
