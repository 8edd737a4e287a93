"""`python -m train.evaluate`: the task's evaluation of a checkpoint or an export, the same as the run's own, written
where RunDir says."""

from __future__ import annotations

import json

from test_export import _cli, swin_run  # noqa: F401 - the module's run fixture

from train.metrics import read_metrics
from train.run_dir import RunDir


def test_a_checkpoint_evaluates_as_the_run_evaluated_it(swin_run):  # noqa: F811
    result = _cli("train.evaluate", swin_run / "checkpoints" / "step_00000004")
    assert result.returncode == 0, result.stderr
    written = json.loads(RunDir(swin_run).eval_file.read_text())
    logged = next(r for r in read_metrics(swin_run) if r["step"] == 4 and "eval/top1" in r)
    assert written["metrics"]["eval/top1"] == logged["eval/top1"]
    assert written["weights"].endswith("step_00000004")


def test_an_export_outside_its_run_evaluates_with_the_config_it_is_given(swin_run, tmp_path):  # noqa: F811
    recorded = RunDir(swin_run).recorded_config()
    (tmp_path / "export").symlink_to(RunDir(swin_run).export_dir)
    result = _cli("train.evaluate", tmp_path / "export", "experiment=swin_demo", f"data.path={recorded.data.path}",
                  "trainer.device=cpu", "data.eval_batch_size=180", "--out", tmp_path / "eval")
    assert result.returncode == 0, result.stderr
    assert "eval/top1" in json.loads(RunDir(tmp_path / "eval").eval_file.read_text())["metrics"]
    refused = _cli("train.evaluate", tmp_path / "export", "experiment=swin_demo")
    assert refused.returncode == 2 and "give --out DIR" in refused.stderr
