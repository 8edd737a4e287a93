"""`python -m train.export`: a run's best, newest or a named checkpoint as the stock export, with Swin's class names;
what it refuses, in one line; where it may write (never over the run or a user's files; an earlier export is
replaced whole)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import timm
import torch
from helpers.runs import run_module

from core.errors import UserError
from train.checkpoint import model_state
from train.export import export
from train.restore import find_weights
from train.run_dir import RunDir


def test_best_checkpoint_exports_for_timm_with_its_class_names(swin_digits_run, tmp_path):
    best = RunDir(swin_digits_run).checkpoints_dir / "best.json"
    best.write_text(json.dumps([{"step": 2, "score": 99.0}]))  # the best is not the newest
    result = run_module("train.export", swin_digits_run, tmp_path / "best", "--best")
    assert result.returncode == 0, result.stderr
    assert "step_00000002" in result.stdout and "Writing model shards" not in result.stdout + result.stderr
    model = timm.create_model(f"local-dir:{tmp_path / 'best'}", pretrained=True)
    assert model.pretrained_cfg["label_names"] == [str(digit) for digit in range(10)]  # the ImageFolder's classes
    assert list(model.pretrained_cfg["mean"]) == [0.5, 0.5, 0.5]
    expected = model_state(RunDir(swin_digits_run).checkpoints_dir / "step_00000002")
    assert all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())


def test_the_newest_checkpoint_is_exported_without_best(swin_digits_run):
    assert find_weights(swin_digits_run).path.name == "step_00000004"
    assert find_weights(swin_digits_run / "checkpoints" / "step_00000002").run_dir == RunDir(swin_digits_run)


@pytest.mark.parametrize(("args", "message"), [
    (["{run}/nowhere", "{tmp}/out"], "does not exist"),
    (["{run}/hf_model", "{tmp}/out"], "is already an export"),
    (["{run}/checkpoints/step_00000004", "{tmp}/out", "--best"], "give the run directory"),
    (["{run}/.hydra", "{tmp}/out"], "is neither a run directory"),
])
def test_what_cannot_be_exported_is_refused_in_one_line(swin_digits_run, tmp_path, args, message):
    result = run_module("train.export", *(a.format(run=swin_digits_run, tmp=tmp_path) for a in args))
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


# ----------------------------------------------------------------------------------------- where an export may go
def _tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` with its content: what a refused export must leave as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("out", "message"), [
    ("{run}", "is the run directory"),
    ("{run}/exports", "is inside the run directory"),
    ("{run}/checkpoints", "is inside the run directory"),
    ("{run}/..", "holds the run directory"),  # OUT=runs: every run
    (".", "holds the run directory"),
])
def test_an_export_into_the_run_or_around_it_is_refused_and_deletes_nothing(swin_digits_run, monkeypatch, out, message):
    monkeypatch.chdir(swin_digits_run.parent)
    before = _tree(swin_digits_run)
    with pytest.raises(UserError, match=message):
        export(swin_digits_run, out.format(run=swin_digits_run))
    assert _tree(swin_digits_run) == before


def test_a_users_folder_or_file_is_refused_in_one_line_and_kept(swin_digits_run, tmp_path):
    folder, file = tmp_path / "mine", tmp_path / "notes.txt"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    file.write_text("notes")
    for out, message in ((folder, "is a folder that is not an export of this project (no export.json)"),
                         (file, "is a file"), (swin_digits_run, "is the run directory")):
        result = run_module("train.export", swin_digits_run, out)
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert (folder / "thesis.tex").read_text() == "years of work" and file.read_text() == "notes"
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(UserError, match="is a symbolic link"):
        export(swin_digits_run, link)


def test_out_tmp_is_left_alone_and_a_re_export_replaces_the_export(swin_digits_run, tmp_path):
    out = tmp_path / "exports" / "swin"
    users = out.with_name("swin.tmp")
    users.mkdir(parents=True)
    (users / "keep.txt").write_text("mine")
    export(swin_digits_run / "checkpoints" / "step_00000002", out)
    assert json.loads((out / "export.json").read_text())["source"].endswith("step_00000002")
    export(swin_digits_run, out)  # an export of this project: replaced, whole
    assert json.loads((out / "export.json").read_text())["source"].endswith("step_00000004")
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True)
    expected = model_state(RunDir(swin_digits_run).checkpoints_dir / "step_00000004")
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
    assert sorted(p.name for p in out.parent.iterdir()) == ["swin", "swin.tmp"]  # no staging or old copy left
    assert (users / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export(swin_digits_run, empty) / "export.json").is_file()  # an empty folder holds nothing to lose


def test_a_run_recorded_before_a_key_was_added_still_exports(swin_digits_run, tmp_path):
    """A key the project added since the run was recorded takes today's default for the run's choices."""
    old_run = RunDir(tmp_path / "old_run")
    shutil.copytree(swin_digits_run, old_run.path)
    cfg = old_run.recorded_config()
    cfg.precision = {"dtype": "fp16", "init_scale": 1048576.0, "growth_interval": 2000}  # without the limit key
    old_run.record_config(cfg, overrides=["experiment=swin_demo", "precision=fp16"])  # what `python -m train` records
    result = run_module("train.export", old_run.path, tmp_path / "export")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "export" / "config.json").is_file()
