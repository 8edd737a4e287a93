"""`python -m benchmarks.paper.convergence`: every run of the study composes with its seed, evaluation points and
setting; the difference to LAMB is measured in its standard error; a small study's table is its runs' summaries."""

from __future__ import annotations

import csv
import json
import math

import pytest
from conftest import compose

from benchmarks.paper import convergence
from train.config import validate

TINY_BERT = ("model.hidden_size=32", "model.intermediate_size=64", "data.dupe_factor=1", "data.max_seq_len=32",
             "data.max_predictions=5", "trainer.global_batch_size=8", "data.heldout_sequences=24")


def test_every_run_of_the_default_study_composes_with_its_seed_and_evaluations(tmp_path):
    args = convergence.parse_args(["--out", str(tmp_path)])
    study = convergence.ConvergenceStudy(args)
    assert {v.label for v in study.variants} >= {"lamb", "slamb", "onebit_lamb", "zero_one_adam", "slowmo"}
    for variant in study.variants:
        for seed in range(args.seeds):
            cfg = compose([o for o in study.bert_command(variant, seed) if not o.startswith("hydra.")])
            validate(cfg)
            assert cfg.optim.name == variant.optimizer and cfg.trainer.seed == seed
            assert (cfg.trainer.max_steps, cfg.trainer.eval_every) == (300, 75)  # evaluated at 75, 150, 225, 300
            assert cfg.trainer.eval_every % cfg.trainer.log_every == 0  # bytes sent are logged at every evaluation
            assert cfg.trainer.nproc_per_node == 4 and cfg.data.name == "shards"
            if "seed" in cfg.optim:  # the optimizer's own draws (masks, layers) change with the seed too
                assert cfg.optim.seed == seed
    by_label = {v.label: v for v in study.variants}
    cfg = compose([o for o in study.bert_command(by_label["slamb always_adapt=false"], 0)
                   if not o.startswith("hydra.")])
    assert cfg.optim.always_adapt is False and cfg.optim.comm_dtype == "fp16"  # one change from the BERT preset
    cfg = compose([o for o in study.bert_command(by_label["onebit_adam warm-up x2"], 0) if not o.startswith("hydra.")])
    assert cfg.optim.freeze_step == 120  # 40 % of 300 steps, not the 60 the 1-bit presets are scaled to


def test_the_difference_to_lamb_is_measured_in_its_standard_error():
    row = convergence.difference_to_reference([1.0, 1.2], [0.9, 0.9])
    assert row["vs lamb"] == pytest.approx(0.2)
    assert row["SE"] == pytest.approx(math.sqrt(0.02) / math.sqrt(2))  # stdev 0.1414 / sqrt(2 seeds); LAMB's is 0
    assert row["vs lamb / SE"] == pytest.approx(2.0)
    assert convergence.difference_to_reference([1.0, 1.0], [1.0, 1.0])["vs lamb / SE"] is None  # no noise: no ratio


def test_a_study_without_lamb_or_with_an_unknown_variant_is_a_one_line_error(capsys):
    for argv, start in ((["--variants", "slamb"], "error: --variants must include lamb"),
                        (["--variants", "lamb", "slamb beta3=2"], "error: --variants slamb beta3=2: not runnable")):
        with pytest.raises(SystemExit) as info:
            convergence.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start)


@pytest.mark.slow
def test_a_small_study_reports_its_runs_validation_losses(tmp_path, capsys):
    study = ["--out", str(tmp_path), "--corpus", "demo", "--variants", "lamb", "slamb", "--seeds", "2", "--steps", "4",
             "--ranks", "2", "--squad-epochs", "0", *(f"--override={o}" for o in TINY_BERT)]
    convergence.main(study)
    table = (tmp_path / "convergence.md").read_text()
    capsys.readouterr()
    convergence.main(study)  # a rerun skips every finished run and rebuilds the same table
    assert capsys.readouterr().out.count("done before") == 4 and (tmp_path / "convergence.md").read_text() == table
    rows = {row["variant"]: row for row in csv.DictReader((tmp_path / "convergence.csv").open())}
    assert list(rows) == ["slamb", "lamb"]  # fewest bits first
    finals = {}
    for name in rows:
        summaries = [json.loads((tmp_path / "bert" / name / f"seed{s}" / "summary.json").read_text()) for s in (0, 1)]
        finals[name] = [s["validation_loss"] for s in summaries]
        assert rows[name]["final per seed"] == " ".join(f"{v:.3f}" for v in finals[name])
        assert float(rows[name]["val loss @4"]) == pytest.approx(sum(finals[name]) / 2)
        assert float(rows[name]["val loss @1"]) > 0  # evaluated at 1, 2, 3 and 4 of 4 steps
    assert finals["slamb"][0] != finals["slamb"][1]  # the seeds differ
    expected = convergence.difference_to_reference(finals["slamb"], finals["lamb"])
    assert float(rows["slamb"]["vs lamb"]) == pytest.approx(expected["vs lamb"])
    assert float(rows["slamb"]["vs lamb / SE"]) == pytest.approx(expected["vs lamb / SE"])
    assert all((tmp_path / f).stat().st_size > 5000 for f in ("val_loss_vs_step.png", "val_loss_vs_bytes.png"))
