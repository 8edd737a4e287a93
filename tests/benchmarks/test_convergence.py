"""`python -m benchmarks.paper.convergence`: every run of the study composes with its seed, evaluation points and
setting; differences to LAMB are paired by seed and put into words by one rule; the shipped page is what its template
renders from the shipped data, and its figures recompute from that data; a small study writes its runs' data."""

from __future__ import annotations

import gzip
import json
import math
import statistics

import pytest
from helpers.config import REPO, compose

from benchmarks.paper import convergence
from benchmarks.paper.convergence_data import DATA_NAME, Point, RunData, StudyData
from benchmarks.paper.convergence_page import Results
from benchmarks.paper.paired import compare, verdict
from train.config import validate

TINY_BERT = ("model.hidden_size=32", "model.intermediate_size=64", "data.dupe_factor=1", "data.max_seq_len=32",
             "data.max_predictions=5", "trainer.global_batch_size=8", "data.heldout_sequences=24")
SHIPPED = REPO / "docs" / "results" / "convergence"


def _composed(study, variant, seed, *more):
    return compose([o for o in study.bert_command(variant, seed, *more) if not o.startswith("hydra.")])


def test_every_run_of_the_default_study_composes_with_its_seed_and_evaluations(tmp_path):
    args = convergence.parse_args(["--out", str(tmp_path)])
    study = convergence.ConvergenceStudy(args)
    labels = {v.label for v in study.variants}
    assert labels >= {"lamb", "slamb", "onebit_lamb", "zero_one_adam", "slowmo", "lamb allreduce=fp16",
                      "lamb always_adapt=true", "onebit_lamb lr=6e-3", "zero_one_adam warm-up x2", "slowmo tau/2",
                      "jointspar sample_ratio=1"}
    for variant in study.variants:
        assert len(study.seeds(variant)) == (3 if variant.label in ("lamb", "slamb") else 2)
        for seed in study.seeds(variant):
            cfg = _composed(study, variant, seed)
            validate(cfg)
            assert cfg.optim.name == variant.optimizer and cfg.trainer.seed == seed
            assert (cfg.trainer.max_steps, cfg.trainer.eval_every) == (300, 75)  # evaluated at 75, 150, 225, 300
            assert cfg.trainer.eval_every % cfg.trainer.log_every == 0  # bytes sent are logged at every evaluation
            assert cfg.trainer.nproc_per_node == 4 and cfg.data.name == "shards"
            if "seed" in cfg.optim:  # the optimizer's own draws (masks, layers) change with the seed too
                assert cfg.optim.seed == seed
    by_label = {v.label: v for v in study.variants}
    cfg = _composed(study, by_label["slamb always_adapt=false"], 0)
    assert cfg.optim.always_adapt is False and cfg.optim.comm_dtype == "fp16"  # one change from the BERT preset
    cfg = _composed(study, by_label["onebit_adam warm-up x2"], 0)
    assert cfg.optim.freeze_step == 120  # 40 % of 300 steps, not the 60 the 1-bit presets are scaled to
    assert _composed(study, by_label["zero_one_adam warm-up x2"], 0).optim.var_freeze_step == 120
    assert _composed(study, by_label["slowmo tau/2"], 0).optim.sync_interval == 15  # the study's 30, halved
    cfg = _composed(study, by_label["onebit_lamb lr=6e-3"], 0)
    assert (cfg.optim.lr, cfg.optim.max_coeff) == (6.0e-3, 0.3)  # LAMB's LR, the published bound
    assert _composed(study, by_label["lamb allreduce=fp16"], 0).trainer.grad_allreduce_dtype == "fp16"
    cfg = _composed(study, by_label["slamb"], 0, convergence.WIRE_KEYS[1:2])  # its run at 32 bits per value
    assert cfg.optim.comm_dtype == "fp32" and cfg.optim.beta3 == 0.99


def test_seeds_for_takes_labels_with_an_equals_sign_and_refuses_a_bad_count(capsys):
    args = convergence.parse_args(["--variants", "lamb", "slamb beta3=0.93", "--seeds-for", "slamb beta3=0.93=4"])
    assert args.seeds_for == {"slamb beta3=0.93": 4}
    with pytest.raises(SystemExit) as info:
        convergence.main(["--seeds-for", "lamb=0"])
    assert info.value.code == 2 and capsys.readouterr().err.strip().startswith("error: --seeds-for lamb=0:")


def test_paired_differences_and_the_rule_that_words_them():
    c = compare({0: 7.018, 1: 7.094}, {0: 6.957, 1: 7.024})  # SLAMB and LAMB, seeds 0 and 1
    assert c.differences == pytest.approx((0.061, 0.070)) and c.mean == pytest.approx(0.0655)
    assert c.paired_se == pytest.approx(0.0045)  # stdev of the differences / sqrt(2)
    assert c.unpaired_difference == pytest.approx(0.0655)
    assert c.unpaired_se == pytest.approx(math.hypot(0.038, 0.0335))  # each mean's stdev / sqrt(2), combined
    assert verdict(c, "lamb") == "trails lamb by 0.066 (paired, 2 seeds)"  # 14.6 paired SE; 1.3 unpaired
    ahead = compare({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 2.4, 2: 3.6})
    assert verdict(ahead, "lamb") == "is ahead of lamb by 0.500 (paired, 3 seeds)"
    mixed = compare({0: 1.1, 1: 0.95}, {0: 1.0, 1: 1.0})  # the seeds disagree on the sign
    assert verdict(mixed, "lamb").startswith("is within noise of lamb (+0.025 \u00b1 0.075, paired, 2 seeds")
    small = compare({0: 1.02, 1: 1.03, 2: 1.001}, {0: 1.0, 1: 1.0, 2: 1.0})  # same sign, under 2 paired SE
    assert verdict(small, "lamb").startswith("is within noise of lamb")
    assert "no spread" in verdict(compare({0: 1.2}, {0: 1.0, 1: 1.1}), "lamb")  # one shared seed
    assert compare({2: 1.0}, {0: 1.0}) is None  # no shared seed: no pairs


def _study() -> StudyData:
    runs = [RunData("lamb", "lamb", seed, (Point(2, 9.0, 8.0 + seed, 100), Point(4, 8.0, 7.0 + seed, 200)),
                    bits_per_param_per_step=32.0, bits_at_fp32=32.0, wall_seconds=60.0) for seed in range(3)]
    runs += [RunData("slamb", "slamb", seed, (Point(2, 9.5, 8.5 + seed, 10), Point(4, 8.2, 7.1 + seed, 20)),
                     bits_per_param_per_step=2.0, bits_at_fp32=3.75) for seed in range(2)]
    return StudyData({"date": "d", "steps": 4}, runs)


def test_results_pair_on_shared_seeds_and_render_a_template(tmp_path):
    results = Results(_study())
    assert results.seeds("lamb") == 3 and results.val("lamb") == pytest.approx(8.0)  # mean over seeds 0-2
    assert results.gap("slamb") == pytest.approx(0.1) and results.comparison("slamb").seeds == (0, 1)
    assert results.comparison("slamb").unpaired_difference == pytest.approx(7.6 - 8.0)  # all of each one's seeds
    assert results.gap("slamb", 2) == pytest.approx(0.5)
    assert results.share("slamb", at_fp32=True) == pytest.approx(3.75 / 32)
    page = results.render('{{ verdict("slamb") }}; {{ pairs("slamb") }}; {{ share("slamb") | .1% }}; '
                          '{{ ", ".join(str(s) for s in steps("lamb")) }}; {{ figures }}', figures="here")
    assert page == "trails lamb by 0.100 (paired, 2 seeds); +0.100 and +0.100; 6.2%; 2, 4; here"
    with pytest.raises(Exception, match=r"template placeholder \{\{ nope\(\) \}\}"):
        results.render("{{ nope() }}")
    StudyData(results.data.meta, results.data.runs).write(tmp_path / DATA_NAME)
    assert StudyData.read(tmp_path / DATA_NAME).runs == results.data.runs  # the file holds the runs exactly


def test_a_setting_is_paired_with_its_own_preset_not_with_lamb():
    data = _study()
    data.runs += [RunData("slamb H=20", "slamb", seed, (Point(4, 8.0, 7.05 + seed, 30),), ("optim.sync_interval=20",),
                          bits_per_param_per_step=3.3, replica_average_bits=0.1) for seed in range(2)]
    results = Results(data)
    assert results.settings() == [("slamb H=20", "slamb")]
    assert results.replica_bits("slamb H=20") == pytest.approx(0.1) and results.replica_bits("slamb") is None
    table = results.settings_table(only="slamb")
    assert "| `slamb H=20` | `slamb` | 7.050 8.050 | 7.550 | -0.050 and -0.050 | is ahead of slamb by 0.050" in table
    assert results.settings_table(but="slamb") == ""  # no setting of another preset


def test_the_shipped_page_is_its_template_rendered_from_the_shipped_data():
    results = Results(StudyData.read(SHIPPED / DATA_NAME))
    template = (SHIPPED / "convergence.md.in").read_text()
    assert (REPO / "docs" / "results" / "convergence.md").read_text() == results.render(template, figures="convergence")
    assert "{{" not in (REPO / "docs" / "results" / "convergence.md").read_text()
    assert (SHIPPED / DATA_NAME).stat().st_size < 5_000_000


def test_the_shipped_data_recomputes_the_pages_paired_figures():
    """Straight from the file, without the page's code: SLAMB against LAMB, seed by seed, at the end and at step 225,
    and against LAMB with SLAMB's rule for biases and LayerNorm."""
    lines = [json.loads(line) for line in gzip.decompress((SHIPPED / DATA_NAME).read_bytes()).decode().splitlines()]
    runs = [line["run"] for line in lines[1:]]
    val = {(r["variant"], r["seed"], p["step"]): p["val_loss"] for r in runs for p in r["points"]
           if p["val_loss"] is not None}

    def differences(variant, reference, step=300, seeds=(0, 1, 2)):
        return [val[variant, s, step] - val[reference, s, step] for s in seeds
                if (variant, s, step) in val and (reference, s, step) in val]

    final = differences("slamb", "lamb")
    assert len(final) == 3 and all(d > 0 for d in final)  # SLAMB trails on every seed
    mean, paired_se = statistics.fmean(final), statistics.stdev(final) / math.sqrt(3)
    assert mean >= 2 * paired_se  # the rule's "trails"
    page = " ".join((REPO / "docs" / "results" / "convergence.md").read_text().split())
    row = page.split("| slamb | ")[1]  # the paired table's row comes first
    assert row.startswith(f"3 | {' '.join(f'{d:+.3f}' for d in final)} | {mean:+.3f} | {paired_se:.3f} |")
    assert f"SLAMB trails LAMB** at the end: it trails lamb by {mean:.3f} (paired, 3 seeds)" in page
    at_225 = differences("slamb", "lamb", 225)
    assert f"{statistics.fmean(at_225):+.3f} ± {statistics.stdev(at_225) / math.sqrt(3):.3f} at step 225" in page
    matched = differences("slamb", "lamb always_adapt=true")
    assert len(matched) == 2 and f"trails lamb always_adapt=true by {statistics.fmean(matched):.3f}" in page


def test_a_study_without_lamb_or_with_an_unknown_variant_is_a_one_line_error(capsys):
    for argv, start in ((["--variants", "slamb"], "error: --variants must include lamb"),
                        (["--variants", "lamb", "slamb beta3=2"], "error: --variants slamb beta3=2: not runnable"),
                        (["--report-only", "--out", "/nonexistent"], "error: /nonexistent/runs.jsonl.gz does not")):
        with pytest.raises(SystemExit) as info:
            convergence.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start)


@pytest.mark.slow
def test_a_small_study_writes_its_runs_data_and_page(tmp_path, capsys):
    study = ["--out", str(tmp_path), "--corpus", "demo", "--variants", "lamb", "slamb", "--seeds", "2",
             "--seeds-for", "lamb=3", "--steps", "4", "--ranks", "2", "--squad-epochs", "0",
             *(f"--override={o}" for o in TINY_BERT)]
    convergence.main(study)
    page = (tmp_path / "convergence.md").read_text()
    capsys.readouterr()
    convergence.main(study)  # a rerun skips every finished run and rebuilds the same page
    out = capsys.readouterr().out
    assert out.count("done before") == 6 and (tmp_path / "convergence.md").read_text() == page  # 3 + 2 + fp32
    data = StudyData.read(tmp_path / DATA_NAME)
    assert [(r.variant, r.seed) for r in data.runs] == [("lamb", 0), ("lamb", 1), ("lamb", 2), ("slamb", 0),
                                                       ("slamb", 1)]
    for run in data.runs:
        summary = json.loads((tmp_path / "bert" / run.variant / f"seed{run.seed}" / "summary.json").read_text())
        assert run.val_loss() == summary["validation_loss"] and [p.step for p in run.points] == [1, 2, 3, 4]
        assert all(p.train_loss is not None and p.val_loss is not None for p in run.points)
        assert run.bits_per_param_per_step == summary["bits_per_param_per_step"]
    slamb = data.seeded("slamb")[0]
    fp32 = json.loads((tmp_path / "bert" / "slamb" / "fp32_seed0" / "summary.json").read_text())
    assert slamb.bits_at_fp32 == fp32["bits_per_param_per_step"] > slamb.bits_per_param_per_step  # fp16 momentum
    assert data.seeded("lamb")[0].bits_at_fp32 == data.seeded("lamb")[0].bits_per_param_per_step  # fp32 already
    results = Results(data)
    assert f"slamb` {results.verdict('slamb')}" in page and results.comparison("slamb").seeds == (0, 1)
    assert all((tmp_path / f).stat().st_size > 5000 for f in ("val_loss_vs_step.png", "val_loss_vs_bytes.png",
                                                             "paired_difference_vs_step.png"))
    convergence.main(["--report-only", "--out", str(tmp_path), "--page", str(tmp_path / "again.md")])
    assert (tmp_path / "again.md").read_text() == page  # from the data alone
