"""The run directory's layout: RunDir names every path a run writes, and those are the paths users see."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.config import QA_TINY, REPO, TINY, compose
from omegaconf import OmegaConf

import train.run_dir
from core.errors import ConfigError
from train.run import run
from train.run_dir import RunDir, check_run_name

# The layout users see (the module docstring's tree): renaming any of these moves files users and tools rely on.
LAYOUT = {
    "config_file": ".hydra/config.yaml",
    "overrides_file": ".hydra/overrides.yaml",
    "choices_file": ".hydra/choices.yaml",
    "checkpoints_dir": "checkpoints",
    "metrics_file": "metrics.jsonl",
    "log_file": "train.log",
    "tensorboard_dir": "tensorboard",
    "wandb_id_file": "wandb_id.txt",
    "predictions_file": "predictions.json",
    "nbest_predictions_file": "nbest_predictions.json",
    "export_dir": "hf_model",
    "ema_export_dir": "hf_model_ema",
    "finished_file": "finished.json",
    "summary_file": "summary.json",
    "eval_file": "eval.json",
    "lock_file": "run.lock",
}
SQUAD_ONLY = {"predictions_file", "nbest_predictions_file"}
# wandb is off in tests; train.evaluate writes eval.json; the lock file goes when the run ends
NOT_BY_TRAINING = {"wandb_id_file", "eval_file", "lock_file"}


def _named(run_dir: RunDir) -> dict[str, Path]:
    """Every path RunDir names, by property."""
    return {name: getattr(run_dir, name) for name, value in vars(RunDir).items() if isinstance(value, property)}


def test_run_dir_names_the_documented_layout():
    run_dir = RunDir("runs/demo")
    assert {name: path.relative_to(run_dir.path).as_posix() for name, path in _named(run_dir).items()} == LAYOUT
    for relative in LAYOUT.values():
        assert f" {Path(relative).name}" in train.run_dir.__doc__


BERT = [*TINY, "trainer.max_steps=2", "logger.tensorboard=true", "trainer.ema_decay=0.9"]
SQUAD = [*QA_TINY, "trainer.init_from=null", "trainer.epochs=null", "trainer.max_steps=1"]


@pytest.mark.parametrize(("overrides", "expected"), [
    (BERT, set(LAYOUT) - SQUAD_ONLY - NOT_BY_TRAINING),
    (SQUAD, set(LAYOUT) - {"tensorboard_dir", "ema_export_dir"} - NOT_BY_TRAINING),
], ids=["bert", "squad"])
def test_a_run_writes_only_the_paths_run_dir_names(tmp_path, overrides, expected):
    run(compose(overrides), tmp_path, overrides=overrides, choices={"model": "bert_tiny"})
    named = _named(RunDir(tmp_path))
    assert {name for name, path in named.items() if path.exists()} == expected
    for path in tmp_path.rglob("*"):  # a file, inside a named directory, or a directory holding a named path
        assert any(path == p or p in path.parents or path in p.parents for p in named.values()), path


def test_the_group_choices_are_recorded_without_hydras_own(tmp_path):
    choices = {"task": "bert_pretraining", "model": "bert_tiny", "experiment": None, "hydra/help": "slamb"}
    RunDir(tmp_path).record_config(compose(), ["model=bert_tiny"], choices)
    assert OmegaConf.load(RunDir(tmp_path).choices_file) == {"task": "bert_pretraining", "model": "bert_tiny",
                                                             "experiment": None}


def test_run_dir_imports_neither_torch_nor_transformers():
    loaded = subprocess.run([sys.executable, "-c", "import sys, train.run_dir; print(sorted(sys.modules))"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "'torch'" not in loaded and "'transformers'" not in loaded


@pytest.mark.parametrize("name", ["", " ", ".", "..", "a/../..", "/tmp/elsewhere", "a//b", "runs/"])
def test_a_name_that_is_no_run_directory_of_its_own_is_refused(name):
    with pytest.raises(ConfigError, match=rf"^name={re.escape(repr(name))} names no run directory of its own under "
                                          r"runs/: give a name such as name=my_run"):
        check_run_name(name)


def test_a_name_too_long_for_the_file_system_is_refused():
    with pytest.raises(ConfigError, match=r"is 201 characters long: at most 200, so that the run's files"):
        check_run_name("a" * 201)
    with pytest.raises(ConfigError, match=r"a directory name may have at most 255 bytes, and 'ééé.*' has 260"):
        check_run_name("é" * 130)
    for fine in ("a" * 200, "phase1/seed_2", "café run", "é" * 127):
        check_run_name(fine)


@pytest.mark.parametrize("name", ["..", "x" * 300])
def test_a_bad_name_is_one_line_before_hydra_makes_a_directory(name, tmp_path):
    """`runs/..` would be the repository itself; 300 characters were Hydra's traceback when it made the directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "train", *TINY, f"name={name}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("config error: name=") and len(result.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # no runs/ made
