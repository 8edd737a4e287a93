"""`python -m benchmarks.data.padding`: a prepared phase's padding is the padding of the sequences its shards hold,
unpacked and packed as training packs them, and the long-document estimate of create_pretraining_data's rule is what
the rule gives."""

from __future__ import annotations

import random

import numpy as np
import pytest
from helpers.corpora import small_config, write_corpus

from benchmarks.data.padding import PACK_SEQUENCES, long_document_padding, prepared_padding
from data.corpus.pipeline import prepare
from data.text.nsp import create_nsp_instances
from data.text.packing import PackedPretrainingDataset
from data.text.shards import ShardSet, load_prepared_dataset, resolve_phase_dir
from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_tokenizer


def test_a_prepared_phase_pads_what_its_shards_leave_empty(tmp_path):
    prepare(small_config(write_corpus(tmp_path / "corpus", num_docs=12), tmp_path / "out", heldout_sequences=0))
    for seq in (64, 128):
        measured = prepared_padding(tmp_path / "out", seq)
        shards = ShardSet(resolve_phase_dir(tmp_path / "out", seq))
        lengths = [len(shards[i].input_ids) for i in range(len(shards))]
        assert (measured.sequences, measured.tokens) == (len(lengths), sum(lengths))
        assert measured.fraction == pytest.approx(1 - np.mean(lengths) / seq)
        assert 0 < measured.fraction < 1
        dataset = load_prepared_dataset(tmp_path / "out", load_tokenizer(), DEFAULT_VOCAB_PATH, seed=0, max_seq_len=seq)
        packed = PackedPretrainingDataset(dataset, PACK_SEQUENCES, seed=0, shard_sizes=shards.shard_sizes)
        assert measured.packed == pytest.approx(packed.padding) and measured.packed < measured.fraction


def test_the_long_document_estimate_weighs_short_targets_by_the_sequences_they_make():
    estimate = long_document_padding(128, 17, documents=4, sentences=300, short_passes=50)
    rng = np.random.default_rng(0)
    docs = [[[1000] * int(n) for n in rng.geometric(1 / 17, 300)] for _ in range(4)]
    counts = {}
    for short, passes in ((0.0, 1), (1.0, 50)):
        instances = create_nsp_instances(docs, 128, random.Random(0), cls_id=101, sep_id=102, dupe_factor=passes,
                                         short_seq_prob=short)
        counts[short] = np.array([len(instances), sum(len(i.input_ids) for i in instances)]) / passes
    full, short = counts[0.0], counts[1.0]
    assert full[1] / (full[0] * 128) > 0.97  # long documents fill every sequence but each document's last
    assert short[0] > 1.5 * full[0]  # short targets make more sequences from the same text
    assert (estimate.sequences, estimate.tokens) == pytest.approx(tuple(0.9 * full + 0.1 * short))
    # The short passes' sequences outnumber a tenth of all: the estimate pads more than a tenth of their padding.
    assert estimate.fraction > 0.1 * (1 - short[1] / (short[0] * 128))
    assert 0 < estimate.packed < estimate.fraction
