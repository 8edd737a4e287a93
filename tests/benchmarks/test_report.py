"""Run records for reporting: time stamps, summary.json, and `python -m benchmarks.paper.report` over real tiny runs."""

from __future__ import annotations

import csv
import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from helpers.config import TINY, compose
from helpers.runs import run_train
from omegaconf import OmegaConf

from benchmarks.paper.plots import PLOTS
from benchmarks.paper.report import main
from train.checkpoint import file_record
from train.metrics import read_metrics
from train.run import run
from train.run_dir import RunDir
from train.summary import best_values, final_values

SUMMARY_FIELDS = {
    "task", "model", "optimizer", "optimizer_options", "world_size", "global_batch_size", "steps", "max_steps",
    "finished", "stopped", "num_params", "final", "best", "bits_per_param_per_step", "bytes_total",
    "replica_average_bits_per_param_per_step", "replica_average_bytes_total",
    "collectives_per_step", "mean_step_seconds", "samples_per_second", "samples_unit", "elapsed_seconds", "device",
    "precision",
    "simulated_network", "torch_version", "validation_loss",
}
# One micro-batch per step (the quickest steps), and the demo's held-out split: runs report a validation loss.
SMALL = [*TINY, "trainer.micro_batch_size=8", "data.heldout_sequences=64"]
RESUMED_ELAPSED = 1000.0  # written into the stopped run's checkpoint: the resumed run must count on from it


def _summary(run_dir: Path) -> dict:
    return json.loads(RunDir(run_dir).summary_file.read_text())


def _bytes_from_records(records: list[dict]) -> float:
    """Bytes sent since step 0, from the per-step means of the training records (each covers the steps since the
    record before it; exact without fp16-skipped steps)."""
    steps = [0] + [r["step"] for r in records]
    return sum((steps[i + 1] - steps[i]) * r["comm_bytes_per_step"] for i, r in enumerate(records))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """A LAMB run stopped after 2 of 3 steps and resumed (its checkpoint's clock set to 1000 s in between), and a
    SLAMB run of 2 steps."""
    root = tmp_path_factory.mktemp("runs")
    lamb, slamb = root / "lamb", root / "slamb"
    run(compose([*SMALL, "trainer.max_steps=3", "trainer.steps_this_run=2"]), lamb)
    stopped = {"summary": _summary(lamb), "records": read_metrics(lamb)}
    shared = lamb / "checkpoints" / "step_00000002" / "shared.pt"
    state = torch.load(shared, weights_only=False)
    stopped["checkpoint_elapsed"] = state["clock"]["elapsed"]
    state["clock"]["elapsed"] = RESUMED_ELAPSED
    torch.save(state, shared)
    meta = json.loads((shared.parent / "meta.json").read_text())
    meta["files"]["shared.pt"] = file_record(shared)  # as if written so: the checksum would refuse it otherwise
    (shared.parent / "meta.json").write_text(json.dumps(meta))
    resumed_at = time.time()
    run(compose([*SMALL, "trainer.max_steps=3"]), lamb)
    run(compose([*SMALL, "optim=slamb", "trainer.max_steps=2"]), slamb)
    return {"lamb": lamb, "slamb": slamb, "stopped": stopped, "resumed_at": resumed_at}


def _check_summary_against_records(summary: dict, records: list[dict]) -> None:
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    assert set(summary) == SUMMARY_FIELDS
    assert summary["steps"] == train[-1]["step"]
    assert summary["final"]["loss"] == train[-1]["loss"]
    last = {**train[-1], **(evals[-1] if evals else {})}
    assert summary["final"] == {k: v for k, v in last.items() if k not in ("step", "time", "elapsed")}
    assert summary["validation_loss"] == (evals[-1]["eval/loss"] if evals else None)
    assert summary["bytes_total"] == _bytes_from_records(train) == train[-1]["comm_bytes_total"]
    bits = 8 * summary["bytes_total"] / summary["steps"] / summary["num_params"]
    assert summary["bits_per_param_per_step"] == pytest.approx(bits)
    # Both means come from the same totals: their product is the samples of one step.
    assert summary["samples_per_second"] * summary["mean_step_seconds"] == pytest.approx(
        summary["global_batch_size"])
    assert summary["elapsed_seconds"] >= train[-1]["elapsed"]


@pytest.mark.parametrize(("name", "steps"), [("lamb", 3), ("slamb", 2)])
def test_summary_fields_equal_the_metrics(runs, name, steps):
    summary = _summary(runs[name])
    _check_summary_against_records(summary, read_metrics(runs[name]))
    cfg = compose([*SMALL, f"optim={name}"])
    assert summary["optimizer"] == name
    assert summary["optimizer_options"] == {k: v for k, v in OmegaConf.to_container(cfg.optim).items()
                                            if k != "name"}
    assert (summary["task"], summary["model"]) == ("bert_pretraining", cfg.model.name)
    assert (summary["steps"], summary["max_steps"], summary["finished"]) == (steps, steps, True)
    assert (summary["world_size"], summary["global_batch_size"]) == (1, 8)
    assert (summary["samples_unit"], summary["device"], summary["precision"]) == ("seq/s", "cpu", "fp32")
    assert summary["simulated_network"] is None
    assert summary["torch_version"] == torch.__version__
    evals = [r for r in read_metrics(runs[name]) if "eval/loss" in r]
    assert [r["step"] for r in evals] == [steps]  # the end of the run evaluates on the demo's held-out split
    assert summary["validation_loss"] == summary["best"]["eval/loss"] == evals[0]["eval/loss"]


def test_a_run_stopped_early_summarises_what_it_did(runs):
    summary, records = runs["stopped"]["summary"], runs["stopped"]["records"]
    _check_summary_against_records(summary, records)
    assert (summary["steps"], summary["max_steps"], summary["finished"]) == (2, 3, False)


def test_elapsed_is_monotone_and_continues_across_a_resume(runs):
    records = [r for r in read_metrics(runs["lamb"]) if "loss" in r]  # the training records
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[:2] == runs["stopped"]["records"]  # the first invocation's records are kept as they were
    assert runs["stopped"]["checkpoint_elapsed"] >= records[1]["elapsed"]  # the checkpoint holds the clock
    elapsed = [r["elapsed"] for r in records]
    assert elapsed == sorted(elapsed) and len(set(elapsed)) == 3
    # The resumed run counts on from the checkpoint's elapsed time, by no more than the wall time it ran.
    assert RESUMED_ELAPSED < elapsed[2] < RESUMED_ELAPSED + records[2]["time"] - runs["resumed_at"]
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    assert _summary(runs["lamb"])["elapsed_seconds"] > elapsed[2]


def test_best_is_the_highest_score_and_the_lowest_loss_and_final_the_last_value():
    records = [
        {"step": 1, "time": 1.0, "elapsed": 0.5, "loss": 3.0},
        {"step": 1, "time": 2.0, "elapsed": 1.0, "eval/top1": 40.0, "eval/ema_top1": 30.0, "eval/loss": 2.0,
         "eval/crop_pct": 0.875},
        {"step": 2, "time": 3.0, "elapsed": 1.5, "loss": 2.5},
        {"step": 2, "time": 4.0, "elapsed": 2.0, "eval/top1": 35.0, "eval/ema_top1": 45.0, "eval/loss": 2.2,
         "eval/crop_pct": 0.875},
    ]
    assert best_values(records) == {"eval/top1": 40.0, "eval/ema_top1": 45.0, "eval/loss": 2.0}
    assert final_values(records) == {"loss": 2.5, "eval/top1": 35.0, "eval/ema_top1": 45.0, "eval/loss": 2.2,
                                     "eval/crop_pct": 0.875}


def _copy_records(run_dir: Path, to: Path, *, with_summary: bool = True) -> Path:
    """A run's metrics, recorded config and (optionally) summary, without its checkpoints and export."""
    layout = RunDir(run_dir)
    ignored = [layout.checkpoints_dir.name, layout.export_dir.name]
    if not with_summary:
        ignored.append(layout.summary_file.name)
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns(*ignored))
    return to


def test_report_table_and_plots_equal_the_summaries(runs, tmp_path, capsys):
    sweep = tmp_path / "sweep"  # a folder of runs, as a Hydra multirun leaves them
    for name in ("lamb", "slamb"):
        _copy_records(runs[name], sweep / name)
    _copy_records(runs["lamb"], sweep / "killed", with_summary=False)  # reported from its records and config
    simulated = RunDir(_copy_records(runs["slamb"], sweep / "simulated")).summary_file
    simulated.write_text(json.dumps({**_summary(runs["slamb"]), "simulated_network": {"gbit_per_s": 10}}))
    out = tmp_path / "report"
    main([str(sweep), "--out", str(out)])

    table = (out / "table.md").read_text()
    assert table in capsys.readouterr().out
    rows = {row["run"]: row for row in csv.DictReader((out / "table.csv").open())}
    assert sorted(rows) == ["killed", "lamb", "simulated", "slamb"]
    assert rows["simulated"]["simulated"] == "simulated"
    summaries = {name: _summary(runs[name]) for name in ("lamb", "slamb")}
    target = max(s["validation_loss"] for s in summaries.values())  # every run has one: compared on it
    for name, summary in summaries.items():
        row = rows[name]
        assert (row["optimizer"], int(row["world_size"]), int(row["steps"])) == (name, 1, summary["steps"])
        for column, field in [("bits_per_param_per_step", "bits_per_param_per_step"), ("bytes_total", "bytes_total"),
                              ("mean_step_seconds", "mean_step_seconds"), ("samples_per_second", "samples_per_second")]:
            assert float(row[column]) == summary[field], column
        assert float(row["final_loss"]) == summary["final"]["loss"]
        assert row["target"] == f"eval/loss {target:.4g}"
        first = next(r for r in read_metrics(runs[name]) if r.get("eval/loss", math.inf) <= target)
        assert float(row["time_to_target_s"]) == first["elapsed"]
        assert row["simulated"] == ""
    killed = rows["killed"]
    assert (killed["optimizer"], killed["steps"], float(killed["final_loss"])) == (
        "lamb", "3", summaries["lamb"]["final"]["loss"])
    assert float(killed["bits_per_param_per_step"]) == summaries["lamb"]["bits_per_param_per_step"]
    assert killed["world_size"] == killed["mean_step_seconds"] == ""  # what only a summary can tell
    for plot in PLOTS:
        data = (out / plot).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, plot


@pytest.mark.parametrize(("path", "error"), [
    ("nowhere", "error: {tmp}/nowhere does not exist"),
    ("nowhere*", "error: {tmp}/nowhere* matches nothing"),
    (".", "error: no runs (directories with metrics.jsonl) in {tmp}/."),
])
def test_bad_paths_exit_2_with_one_line(tmp_path, capsys, path, error):
    with pytest.raises(SystemExit) as exit_info:
        main([f"{tmp_path}/{path}", "--out", str(tmp_path / "report")])
    assert exit_info.value.code == 2
    assert capsys.readouterr() == ("", error.format(tmp=tmp_path) + "\n")
    assert not (tmp_path / "report").exists()


def test_an_out_file_or_a_cut_summary_exits_2_with_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "elapsed": 0.5}\n')
    (tmp_path / "report.txt").write_text("")
    (run / "summary.json").write_text('{"optimizer": "lamb", "fin')  # cut mid-write
    for out, error in ((tmp_path / "report.txt", f"error: --out {tmp_path / 'report.txt'} is a file: name a folder "
                                                 "for the table and plots"),
                       (tmp_path / "report", f"error: {run / 'summary.json'} is not valid JSON (")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(run), "--out", str(out)])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1 and captured.err.startswith(error)


@pytest.mark.slow
def test_two_rank_summary_counts_the_bytes_the_records_show(tmp_path):
    result = run_train([*TINY, "optim=slamb", "trainer.nproc_per_node=2", "trainer.max_steps=4",
                        "trainer.log_every=3", "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary, records = _summary(tmp_path), read_metrics(tmp_path)
    assert [r["step"] for r in records if "loss" in r] == [3, 4]  # a window of 3 steps, then the last one
    _check_summary_against_records(summary, records)
    assert summary["world_size"] == 2 and summary["bytes_total"] > 0
    assert 0 < summary["bits_per_param_per_step"] < 32


def _fake_run(run_dir: Path, task: str, overrides: list[str]) -> Path:
    """A run directory as a Hydra multirun job leaves it, with one training record."""
    RunDir(run_dir).overrides_file.parent.mkdir(parents=True)
    RunDir(run_dir).overrides_file.write_text(OmegaConf.to_yaml(OmegaConf.create(overrides)))
    RunDir(run_dir).metrics_file.write_text(json.dumps({"step": 1, "loss": 2.0, "elapsed": 1.0}) + "\n")
    RunDir(run_dir).summary_file.write_text(json.dumps({"task": task, "optimizer": "lamb", "final": {"loss": 2.0}}))
    return run_dir


def test_multirun_jobs_are_named_by_the_overrides_that_set_them_apart(tmp_path):
    from benchmarks.paper.report import find_runs, load_runs

    sweep = tmp_path / "demo-multirun"
    for job, optim in enumerate(["lamb", "adamw"]):
        _fake_run(sweep / str(job), "bert_pretraining", [f"optim={optim}", "trainer.max_steps=4"])
    assert [run.name for run in load_runs(find_runs([str(sweep)]))] == ["optim=lamb", "optim=adamw"]


def test_runs_of_different_tasks_are_refused_in_one_line(tmp_path, capsys):
    _fake_run(tmp_path / "bert", "bert_pretraining", [])
    _fake_run(tmp_path / "swin", "image_classification", [])
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), "--out", str(tmp_path / "report")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: runs of 2 tasks (bert_pretraining: bert; image_classification: swin): "
                                       "report each task's runs separately\n")


def _plotted(name: str, optimizer: str, losses: list[float], sent: float, bits: float):
    from benchmarks.paper.report import Run

    records = [{"step": i + 1, "loss": loss, "elapsed": i + 1.0, "comm_bytes_total": sent * (i + 1)}
               for i, loss in enumerate(losses)]
    return Run(name=name, path=Path(name), summary={"optimizer": optimizer, "bits_per_param_per_step": bits},
               records=records)


def test_a_diverging_run_is_cut_and_marked_and_the_others_keep_the_axis():
    import matplotlib.pyplot as plt

    from benchmarks.paper.plots import loss_vs_step

    runs = [_plotted("lamb", "lamb", [11.0, 9.0, 8.0], 1e6, 32.0),
            _plotted("zero_one_adam", "zero_one_adam", [11.0, 73.0, 12.0], 1e5, 5.0)]
    fig, ax = plt.subplots()
    loss_vs_step(ax, runs)
    assert ax.get_ylim()[1] < 1.25 * 11.0 * 1.1  # the spike to 73 does not set the axis
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lamb", "zero_one_adam (peaks at 73)"]
    assert any("loss axis cut at 13.8" in t.get_text() for t in ax.texts)
    plt.close(fig)


def test_runs_that_sent_nothing_are_named_and_bits_start_at_zero():
    import matplotlib.pyplot as plt

    from benchmarks.paper.plots import bits_per_param, loss_vs_bytes

    runs = [_plotted("optim=adamw", "adamw", [11.0, 10.0], 0.0, 0.0), _plotted("lamb-run", "lamb", [11.0, 9.0], 0, 0)]
    fig, (bytes_ax, bits_ax) = plt.subplots(1, 2)
    loss_vs_bytes(bytes_ax, runs)
    assert "optim=adamw, lamb-run\nsent nothing (one rank)" in bytes_ax.texts[0].get_text()
    bits_per_param(bits_ax, runs)
    assert bits_ax.get_ylim() == (0.0, 1.0)
    assert [t.get_text() for t in bits_ax.get_xticklabels()] == ["optim=adamw", "lamb-run"]
    assert [t.get_text() for t in bits_ax.texts] == ["0: sent nothing"] * 2
    plt.close(fig)
