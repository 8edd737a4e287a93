"""A BERT run on packed rows (data.pack_sequences): it trains, evaluates, resumes exactly and exports stock
BertForPreTraining weights, and a bad value of the option is one line and exit code 2."""

from __future__ import annotations

import json

import pytest
from helpers.config import TINY, compose
from helpers.runs import run_train
from transformers import BertForPreTraining

from train.checkpoint import RunDirectoryError
from train.metrics import read_metrics
from train.run import run

# phase 2's shape (seq 512, 80 predictions) on TINY's model: the demo corpus pads 31 % of it unpacked
PACKED = [*TINY, "data.max_seq_len=512", "data.max_predictions=80", "data.pack_sequences=3", "trainer.max_steps=4",
          "trainer.global_batch_size=4", "data.heldout_sequences=16", "data.eval_batch_size=8"]


def _series(run_dir) -> list[tuple]:
    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in read_metrics(run_dir)
            if "loss" in r]


def test_a_packed_run_trains_evaluates_and_resumes_exactly(tmp_path):
    run(compose(PACKED), tmp_path / "ref")
    run(compose([*PACKED, "trainer.steps_this_run=2"]), tmp_path / "cut")
    run(compose(PACKED), tmp_path / "cut")
    records = [r for r in read_metrics(tmp_path / "ref") if "loss" in r]
    assert len(records) == 4 and sum(r["sequences_per_row"] for r in records) > 4  # rows of several sequences
    assert sum(r["tokens_per_seq"] for r in records) / 4 > 0.8 * 512  # real tokens per row: little padding left
    assert _series(tmp_path / "cut") == _series(tmp_path / "ref")  # bit-identical after the restart
    summary = json.loads((tmp_path / "ref" / "summary.json").read_text())
    assert 0 < summary["validation_loss"] < 20
    # packing changes the inputs, not the weights: the export is stock BertForPreTraining's, every tensor found
    _, info = BertForPreTraining.from_pretrained(tmp_path / "ref" / "hf_model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_a_bad_pack_sequences_is_one_line_and_exit_2(tmp_path):
    result = run_train([*TINY, "data.pack_sequences=0", f"hydra.run.dir={tmp_path}"], timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "config error: data.pack_sequences=0 must be the most sequences per row: 1 (no packing) or more"]
    assert not (tmp_path / "checkpoints").exists()


def test_checkpoints_continue_only_with_the_packing_they_were_trained_with(tmp_path):
    """The data position counts rows: other rows would silently be other data (an unpacked run of an earlier version,
    whose recorded config has no pack_sequences, counts sequences)."""
    run(compose([*TINY, "trainer.max_steps=4", "trainer.steps_this_run=2"]), tmp_path)
    with pytest.raises(RunDirectoryError, match=r"^data\.pack_sequences=2: .* was trained with data\.pack_sequences=1 "
                                                 r"\(checkpoint step_00000002\), .*resume with data\.pack_sequences=1"):
        run(compose([*TINY, "trainer.max_steps=4", "data.pack_sequences=2"]), tmp_path)
