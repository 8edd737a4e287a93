"""Sequence packing: the plan (deterministic, each sequence once, rows fit) and packed rows that keep every sequence
as it is unpacked (tokens, segments, positions, masks, NSP label)."""

from __future__ import annotations

import unittest.mock

import numpy as np
import pytest
import torch

from data.text.masking import IGNORE_INDEX, MLMMasker
from data.text.nsp import PretrainingInstance
from data.text.packing import PACKED_BATCH_KEYS, PackedPretrainingDataset, plan_rows, row_predictions
from data.text.pretraining import PretrainingDataset

CLS, SEP, MASK = 1, 2, 3
MASKER = MLMMasker(vocab_size=200, mask_token_id=MASK, special_token_ids=(0, CLS, SEP), max_predictions=6)


def random_instances(count: int, max_seq_len: int, seed: int = 0) -> list[PretrainingInstance]:
    """`[CLS] A [SEP] B [SEP]` of random lengths in [5, max_seq_len], A and B of random tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(5, max_seq_len + 1))
        a = int(rng.integers(1, n - 3))
        ids = np.concatenate([[CLS], rng.integers(10, 200, a), [SEP], rng.integers(10, 200, n - a - 3), [SEP]])
        types = np.concatenate([np.zeros(a + 2, np.int64), np.ones(n - a - 2, np.int64)])
        out.append(PretrainingInstance(ids.astype(np.int64), types, int(rng.integers(0, 2))))
    return out


def dataset(count: int = 60, max_seq_len: int = 32, seed: int = 0) -> PretrainingDataset:
    return PretrainingDataset(random_instances(count, max_seq_len, seed), max_seq_len, MASKER.max_predictions,
                              masker=MASKER, seed=7)


def test_the_plan_places_every_sequence_once_in_rows_that_fit():
    lengths = np.random.default_rng(1).integers(1, 513, 2000)
    rows = plan_rows(lengths, 512, 3, seed=5)
    placed = np.concatenate(rows)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert all(1 <= len(row) <= 3 and lengths[row].sum() <= 512 for row in rows)
    assert rows == plan_rows(lengths, 512, 3, seed=5)  # every rank, every restart: the same rows
    assert rows != plan_rows(lengths, 512, 3, seed=6)  # the seed orders the ties
    assert len(rows) < 0.75 * len(lengths)  # uniform lengths: most rows hold two or three sequences


def test_the_plan_refuses_a_sequence_longer_than_a_row():
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 8\]"):
        plan_rows(np.array([3, 9]), 8, 2, seed=0)


def test_packing_lowers_the_padding_of_the_demo_corpus_at_phase_2():
    from data.text.pretraining import build_demo_dataset
    from data.text.tokenizer import load_tokenizer

    demo = build_demo_dataset(load_tokenizer(), max_seq_len=512, max_predictions=80, dupe_factor=1)
    unpacked = 1 - sum(len(inst.input_ids) for inst in demo.instances) / (len(demo) * 512)
    packed = PackedPretrainingDataset(demo, 3, seed=0)
    assert unpacked > 0.25 and packed.padding < 0.05
    assert packed.tokens == sum(len(inst.input_ids) for inst in demo.instances)


def test_a_packed_row_holds_each_sequence_as_it_is_unpacked():
    plain = dataset()
    packed = PackedPretrainingDataset(plain, 3, seed=0)
    assert packed.predictions == row_predictions(32, 6, 3, MASKER.masked_lm_prob) == 3 + 4
    seen = []
    for row in range(len(packed)):
        sample = packed.get_item(row, epoch=2)
        assert set(sample) == set(PACKED_BATCH_KEYS)
        numbers = sample["attention_mask"]
        predicted = sample["masked_lm_labels"] != IGNORE_INDEX
        for number, index in enumerate(packed.row(row).tolist()):
            seen.append(index)
            alone = plain.get_item(index, epoch=2)  # the same masks: dynamic masking keys on (seed, epoch, index)
            at = np.flatnonzero(numbers == number + 1)
            n = int(alone["attention_mask"].sum())
            assert len(at) == n and at[0] == sample["cls_positions"][number] and np.all(np.diff(at) == 1)
            np.testing.assert_array_equal(sample["input_ids"][at], alone["input_ids"][:n])
            np.testing.assert_array_equal(sample["token_type_ids"][at], alone["token_type_ids"][:n])
            np.testing.assert_array_equal(sample["position_ids"][at], np.arange(n))
            assert sample["next_sentence_label"][number] == alone["next_sentence_label"]
            mine = predicted & np.isin(sample["masked_lm_positions"], at)
            used = alone["masked_lm_labels"] != IGNORE_INDEX
            offsets = sample["masked_lm_positions"][mine] - at[0]
            np.testing.assert_array_equal(offsets, alone["masked_lm_positions"][used])
            np.testing.assert_array_equal(sample["masked_lm_labels"][mine], alone["masked_lm_labels"][used])
        count = len(packed.row(row))
        assert (sample["next_sentence_label"][count:] == IGNORE_INDEX).all()
        assert (sample["input_ids"][numbers == 0] == plain.pad_token_id).all()
    assert sorted(seen) == list(range(len(plain)))


def test_sharded_data_is_packed_within_each_shard():
    plain = dataset(count=50)
    packed = PackedPretrainingDataset(plain, 2, seed=0, shard_sizes=[20, 30])
    starts = np.cumsum([0, *packed.shard_sizes])
    assert starts[-1] == len(packed)
    for shard, (low, high) in enumerate([(0, 20), (20, 50)]):
        members = np.concatenate([packed.row(row) for row in range(starts[shard], starts[shard + 1])])
        assert sorted(members.tolist()) == list(range(low, high))


def test_shards_are_packed_from_their_own_lengths_and_read_by_the_resumable_loader(tmp_path):
    from helpers.corpora import small_config, write_corpus

    from data import ResumableLoader
    from data.corpus.pipeline import PhaseConfig, prepare
    from data.text.shards import ShardSet, load_prepared_dataset
    from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_tokenizer

    corpus = write_corpus(tmp_path / "corpus", num_docs=30)  # several shards
    prepare(small_config(corpus, tmp_path / "out", phases={"seq128": PhaseConfig(128, 20)}, masking="dynamic",
                         dupe_factor=1, heldout_sequences=0))
    shards = load_prepared_dataset(tmp_path / "out", load_tokenizer(), DEFAULT_VOCAB_PATH, seed=3, max_seq_len=128,
                                   max_predictions=20, masking="dynamic", masked_lm_prob=0.15, short_seq_prob=0.1,
                                   dupe_factor=1)
    sizes = shards.instances.shard_sizes
    assert len(sizes) > 1
    lengths = np.concatenate([shards.instances.sequence_lengths(s) for s in range(len(sizes))])
    np.testing.assert_array_equal(lengths, [len(shards.instances[i].input_ids) for i in range(len(shards))])
    # The plan reads each shard's length column, no shard whole: the data is read once, by training.
    with unittest.mock.patch.object(ShardSet, "_verified_bytes", side_effect=AssertionError("a shard read whole")):
        packed = PackedPretrainingDataset(shards, 3, seed=3, shard_sizes=sizes)
    loader = ResumableLoader(packed, 4, 0, 1, seed=3, shard_sizes=packed.shard_sizes)
    first = [next(loader) for _ in range(3)]
    state = loader.state_dict()
    after = next(loader)
    # A restart plans again: the position is a row index, and the new plan's row holds the same sequences.
    restarted = PackedPretrainingDataset(shards, 3, seed=3, shard_sizes=sizes)
    loader = ResumableLoader(restarted, 4, 0, 1, seed=3, shard_sizes=restarted.shard_sizes)
    loader.load_state_dict(state)
    resumed = next(loader)
    assert all(torch.equal(after[key], resumed[key]) for key in PACKED_BATCH_KEYS)
    assert all((b["attention_mask"] > 0).sum() > 0 for b in first)


def test_shards_written_before_the_length_column_are_planned_from_their_decoded_rows(tmp_path):
    import json

    import pyarrow.parquet as pq
    from helpers.corpora import small_config, write_corpus

    from data.corpus.pipeline import PhaseConfig, prepare
    from data.text.shards import MANIFEST_NAME, ShardSet, sha256_file

    corpus = write_corpus(tmp_path / "corpus", num_docs=10)
    prepare(small_config(corpus, tmp_path / "out", phases={"seq128": PhaseConfig(128, 20)}, masking="dynamic",
                         dupe_factor=1, heldout_sequences=0))
    phase = next(path.parent for path in (tmp_path / "out").rglob(MANIFEST_NAME))
    expected = ShardSet(phase).sequence_lengths(0)
    manifest = json.loads((phase / MANIFEST_NAME).read_text())
    record = manifest["shards"][0]
    path = phase / record["file"]
    pq.write_table(pq.read_table(path).drop_columns(["length"]), path)  # as the shards of older versions were
    record.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (phase / MANIFEST_NAME).write_text(json.dumps(manifest))
    np.testing.assert_array_equal(ShardSet(phase).sequence_lengths(0), expected)
