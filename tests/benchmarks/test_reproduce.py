"""`python -m benchmarks.paper.reproduce`: every algorithm's stages happen within the study's steps, the commands
compose, and a small study writes a comparison whose numbers are its runs' summaries."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from helpers.config import compose

from benchmarks.common import REPO, freeze_kinds
from benchmarks.paper import reproduce, stages
from optim.zero_one_adam import zero_one_adam_step_kinds
from train.config import validate
from train.run_dir import RunDir

TINY_BERT = ("model.hidden_size=32", "model.intermediate_size=64", "data.dupe_factor=1", "data.max_seq_len=32",
             "data.max_predictions=5", "trainer.global_batch_size=8")


def _option(overrides: list[str], key: str) -> int:
    return int(next(o.split("=", 1)[1] for o in overrides if o.startswith(f"optim.{key}=")))


@pytest.mark.parametrize("steps", [20, 100, 1000])
def test_every_stage_of_every_algorithm_happens_within_the_steps(steps):
    for name in ("onebit_adam", "onebit_lamb"):
        kinds = Counter(freeze_kinds(steps, _option(stages.schedule_overrides(name, steps), "freeze_step")))
        assert kinds["dense"] >= steps // 10 and kinds["compressed"] >= steps // 2
    overrides = stages.schedule_overrides("zero_one_adam", steps)
    kinds = Counter(zero_one_adam_step_kinds(steps, _option(overrides, "var_freeze_step"),
                                             _option(overrides, "var_update_scaler"),
                                             _option(overrides, "local_step_scaler")))
    assert all(kinds[k] > 0 for k in ("variance", "onebit_grad", "sync", "local")), kinds
    tau = _option(stages.schedule_overrides("slowmo", steps), "sync_interval")
    assert steps % tau == 0 and 1 < tau <= steps // 10  # replicas agree at the end; several averages


def test_every_command_of_a_study_composes_and_validates(tmp_path):
    study = reproduce.Study(reproduce.parse_args(["--out", str(tmp_path), "--simulated-network", "10gbe"]))
    for name in reproduce.parse_args([]).optimizers:
        command = study.bert_command(name)
        cfg = compose([o for o in command if not o.startswith("hydra.")])
        validate(cfg)
        assert cfg.optim.name == name and cfg.trainer.nproc_per_node == 4 and cfg.trainer.max_steps == 60
        assert cfg.trainer.simulated_network == "10gbe"
    squad = compose([o for o in study.squad_command("lamb") if not o.startswith("hydra.")])  # weights: not yet
    assert squad.trainer.init_from == str(tmp_path / "bert" / "lamb" / "hf_model")
    swin = compose([o for o in study.swin_command("slamb") if not o.startswith("hydra.")])
    validate(swin)
    assert swin.optim.name == "slamb" and swin.trainer.epochs == 15 and swin.trainer.nproc_per_node == 4


def test_bad_arguments_are_one_line_user_errors(capsys):
    with pytest.raises(SystemExit) as info:
        reproduce.main(["--optimizers", "sgd_plus"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --optimizers sgd_plus: not runnable here; choose from {', '.join(reproduce.runnable_optimizers())}"]


@pytest.mark.slow
def test_a_small_study_joins_its_runs_summaries(tmp_path, capsys):
    study = ["--out", str(tmp_path), "--corpus", "demo", "--optimizers", "lamb", "slamb", "--steps", "4",
             "--ranks", "2", "--squad-epochs", "1", "--swin-optimizers", "adamw", "--swin-epochs", "1",
             *(f"--override={o}" for o in TINY_BERT)]
    reproduce.main(study)
    table = (tmp_path / "comparison.md").read_text()
    capsys.readouterr()
    reproduce.main(study)  # a rerun skips every finished run and rebuilds the same table
    assert capsys.readouterr().out.count("done before") == 5 and (tmp_path / "comparison.md").read_text() == table
    rows = {row["optimizer"]: row for row in csv.DictReader((tmp_path / "comparison.csv").open())}
    assert list(rows) == ["slamb", "lamb", "adamw"]  # fewest bits first, the Swin-only row last
    for name in ("lamb", "slamb"):
        summary = json.loads((tmp_path / "bert" / name / "summary.json").read_text())
        assert float(rows[name]["bits/param/step"]) == pytest.approx(summary["bits_per_param_per_step"], abs=1e-3)
        assert float(rows[name]["pretraining loss"]) == pytest.approx(summary["final"]["loss"], abs=1e-3)
        squad = json.loads((tmp_path / "squad" / name / "summary.json").read_text())
        assert float(rows[name]["SQuAD F1"]) == pytest.approx(squad["best"]["eval/f1"], abs=0.05)
    assert float(rows["lamb"]["bits/param/step"]) == pytest.approx(32.0)
    assert float(rows["slamb"]["vs lamb"]) < 0.5  # k = 0.1 of the momentum, plus the periodic average
    assert rows["adamw"]["Swin top-1"] and not rows["adamw"]["pretraining loss"]
    assert "| lamb |" in (tmp_path / "comparison.md").read_text()
    assert all((tmp_path / "report" / f).stat().st_size > 0 for f in ("table.md", "loss_vs_step.png"))



@pytest.mark.slow
def test_ctrl_c_during_a_one_process_stage_saves_it_for_the_rerun(tmp_path):
    """SIGINT to the study reaches the running `python -m train` stage, which saves its stop checkpoint; the study
    exits 130 with one line, and the stage's next run resumes from that checkpoint."""
    steps = 5000  # far more than the test waits for
    study = ["--out", str(tmp_path), "--corpus", "demo", "--optimizers", "lamb", "--steps", str(steps),
             "--ranks", "1", "--squad-epochs", "0", "--swin-optimizers", *(f"--override={o}" for o in TINY_BERT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.paper.reproduce", *study], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "bert" / "lamb"
    deadline = time.monotonic() + 120
    metrics = RunDir(run_dir).metrics_file
    # Training has started: a step was logged (the file itself is opened at start-up, before the stop handler).
    while not (metrics.is_file() and metrics.stat().st_size > 0):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert err.strip().splitlines() == [f"stopped by SIGINT during bert lamb ({run_dir}); rerun the same command "
                                        "to resume it"]
    assert "SIGINT: stopping at step" in RunDir(run_dir).log_file.read_text()
    command = reproduce.Study(reproduce.parse_args(study)).bert_command("lamb")
    rerun = subprocess.run([sys.executable, "-m", "train", *command, "trainer.steps_this_run=1"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {RunDir(run_dir).checkpoints_dir}" in RunDir(run_dir).log_file.read_text()
