"""`python -m train.pipeline`: a stage's config error says what to fix, a stop names the stage, and run names and
directories with spaces or non-ASCII letters reach the stages intact."""

from __future__ import annotations

import signal
import subprocess

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from train import pipeline
from train.subprocess_stage import StageStopped


def _stages_exit(monkeypatch, outcome) -> list[list[str]]:
    started = []

    def run_stage(command, stage, **_):
        started.append(command)
        if isinstance(outcome, BaseException):
            raise outcome
        return subprocess.CompletedProcess(command, outcome)

    monkeypatch.setattr(pipeline, "run_stage", run_stage)
    return started


def test_a_stage_that_refuses_its_settings_stops_the_pipeline_saying_what_to_fix(monkeypatch, capsys):
    started = _stages_exit(monkeypatch, 2)
    with pytest.raises(SystemExit) as info:
        pipeline.main(["--phase1", "optim.lr=-1"])
    assert info.value.code == 2 and len(started) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: pipeline stopped: stage phase1 refused its settings (the line above names the value); fix it in "
        "--phase1 or --all and rerun: finished stages are skipped"]


def test_a_failed_stage_is_resumed_by_a_rerun(monkeypatch, capsys):
    _stages_exit(monkeypatch, 1)
    assert pipeline.main([]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "pipeline stopped: stage phase1 failed (exit 1); rerun the same command to resume it"]


def test_ctrl_c_during_a_stage_exits_130_naming_it(monkeypatch, capsys):
    _stages_exit(monkeypatch, StageStopped(signal.SIGINT, "stage phase2"))
    with pytest.raises(SystemExit) as info:
        pipeline.main([])
    assert info.value.code == 130
    assert capsys.readouterr().err == ("stopped by SIGINT during stage phase2; rerun the same command to resume "
                                       "it\n")


def test_names_and_directories_with_spaces_or_accents_reach_the_stages_intact(tmp_path):
    runs = tmp_path / "my runs"
    command = pipeline.stage_command("squad", "bert résumé", runs, [])
    parsed = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(command[3:])}
    assert parsed["name"] == "bert résumé_squad" and parsed["hydra.run.dir"] == str(runs / "bert résumé_squad")
    assert parsed["trainer.init_from"] == str(runs / "bert résumé_phase2" / "hf_model")
