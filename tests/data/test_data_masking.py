"""MLM masking: the 80/10/10 rule, fixed-size outputs, static vs dynamic masks, and the batch format."""

import numpy as np
import pytest
import torch

from data.text.masking import IGNORE_INDEX, MLMMasker, masking_rng
from data.text.pretraining import BATCH_KEYS, build_demo_dataset, collate_pretraining_batch

VOCAB, PAD, UNK, CLS, SEP, MASK = 30522, 0, 100, 101, 102, 103
SPECIAL = (PAD, UNK, CLS, SEP, MASK)
P = 20


@pytest.fixture(scope="module")
def masker():
    return MLMMasker(vocab_size=VOCAB, mask_token_id=MASK, special_token_ids=SPECIAL, max_predictions=P)


def _sequence(rng, n_words, n_pad=0, n_unk=0):
    words = rng.integers(1000, VOCAB, size=n_words)
    words[rng.choice(n_words, size=n_unk, replace=False)] = UNK
    half = n_words // 2
    return np.concatenate([[CLS], words[:half], [SEP], words[half:], [SEP], np.full(n_pad, PAD)])


def test_masker_from_tokenizer_matches_vocab(tokenizer):
    m = MLMMasker.from_tokenizer(tokenizer, max_predictions=P)
    assert m.vocab_size == VOCAB and m.mask_token_id == MASK
    assert set(m.special_token_ids) == set(SPECIAL)


def test_output_is_fixed_size_with_ignored_unused_slots(masker):
    rng = np.random.default_rng(0)
    for n_words in (1, 3, 20, 60, 125, 400):
        ids = _sequence(rng, n_words, n_pad=7)
        out = masker(ids, masking_rng(0, n_words))
        assert out.masked_lm_positions.shape == (P,) and out.masked_lm_labels.shape == (P,)
        assert out.masked_lm_positions.dtype == np.int64 and out.masked_lm_labels.dtype == np.int64
        assert out.input_ids.shape == ids.shape
        k = int((out.masked_lm_labels != IGNORE_INDEX).sum())
        assert k == min(P, max(1, round(0.15 * n_words)))  # 15% of eligible, at least 1, at most P
        assert np.all(out.masked_lm_labels[k:] == IGNORE_INDEX) and np.all(out.masked_lm_positions[k:] == 0)
        used = out.masked_lm_positions[:k]
        assert np.all(np.diff(used) > 0)  # sorted, no duplicates
        np.testing.assert_array_equal(out.masked_lm_labels[:k], ids[used])  # labels are the original ids
        unchosen = np.setdiff1d(np.arange(len(ids)), used)
        np.testing.assert_array_equal(out.input_ids[unchosen], ids[unchosen])  # only chosen tokens change


def test_no_eligible_tokens_gives_no_predictions(masker):
    out = masker(np.array([CLS, UNK, SEP, UNK, SEP, PAD, PAD]), masking_rng(0))
    assert np.all(out.masked_lm_labels == IGNORE_INDEX) and np.all(out.masked_lm_positions == 0)


def test_rates_and_80_10_10_split_over_many_draws(masker):
    rng = np.random.default_rng(1)
    n_eligible = n_predicted = n_mask = n_random = n_keep = 0
    for i in range(3000):
        ids = _sequence(rng, int(rng.integers(20, 126)), n_pad=int(rng.integers(0, 10)), n_unk=2)
        out = masker(ids, masking_rng(5, i))
        special = np.isin(ids, SPECIAL)
        k = int((out.masked_lm_labels != IGNORE_INDEX).sum())
        pos = out.masked_lm_positions[:k]
        assert not special[pos].any()  # never [CLS], [SEP], [PAD] or [UNK]
        np.testing.assert_array_equal(out.input_ids[special], ids[special])
        new = out.input_ids[pos]
        n_eligible += int((~special).sum())
        n_predicted += k
        n_mask += int((new == MASK).sum())
        n_keep += int((new == ids[pos]).sum())
        replaced = new[(new != MASK) & (new != ids[pos])]
        assert not np.isin(replaced, SPECIAL).any()  # random replacements are never special tokens
        n_random += len(replaced)
    assert n_predicted / n_eligible == pytest.approx(0.15, abs=0.005)
    assert n_mask / n_predicted == pytest.approx(0.8, abs=0.015)
    assert n_random / n_predicted == pytest.approx(0.1, abs=0.01)
    assert n_keep / n_predicted == pytest.approx(0.1, abs=0.01)


def test_same_key_same_mask_and_different_key_differs(masker):
    ids = _sequence(np.random.default_rng(2), 120)
    a, b = masker(ids, masking_rng(1, 0, 5)), masker(ids, masking_rng(1, 0, 5))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    for other in (masking_rng(2, 0, 5), masking_rng(1, 1, 5), masking_rng(1, 0, 6)):
        assert not np.array_equal(masker(ids, other).masked_lm_positions, a.masked_lm_positions)


def test_masker_leaves_input_untouched_and_global_rng_alone(masker):
    ids = _sequence(np.random.default_rng(3), 50)
    before, np_state, torch_state = ids.copy(), np.random.get_state(), torch.get_rng_state()
    masker(ids, masking_rng(0, 1))
    np.testing.assert_array_equal(ids, before)
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_invalid_masker_settings_are_clear_errors():
    with pytest.raises(ValueError, match="masked_lm_prob"):
        MLMMasker(vocab_size=VOCAB, mask_token_id=MASK, special_token_ids=SPECIAL, masked_lm_prob=0.0)
    with pytest.raises(ValueError, match="max_predictions"):
        MLMMasker(vocab_size=VOCAB, mask_token_id=MASK, special_token_ids=SPECIAL, max_predictions=0)
    with pytest.raises(ValueError, match="mask_token_id"):
        MLMMasker(vocab_size=50, mask_token_id=MASK, special_token_ids=(0,))
    with pytest.raises(ValueError, match="non-negative"):
        masking_rng(-1, 0)


@pytest.fixture(scope="module")
def static_ds(tokenizer):
    return build_demo_dataset(tokenizer, max_seq_len=64, max_predictions=10, dupe_factor=1, seed=3,
                              masking="static")


@pytest.fixture(scope="module")
def dynamic_ds(tokenizer):
    return build_demo_dataset(tokenizer, max_seq_len=64, max_predictions=10, dupe_factor=1, seed=3,
                              masking="dynamic")


def test_static_masks_do_not_change_across_epochs(static_ds):
    for i in (0, 17, len(static_ds) - 1):
        a, b = static_ds.get_item(i, epoch=0), static_ds.get_item(i, epoch=4)
        for key in BATCH_KEYS:
            np.testing.assert_array_equal(a[key], b[key])


def test_dynamic_masks_change_per_epoch_and_equal_static_in_epoch_0(static_ds, dynamic_ds):
    assert len(static_ds) == len(dynamic_ds)
    changed = 0
    for i in range(0, len(dynamic_ds), 37):
        e0, e1 = dynamic_ds.get_item(i, 0), dynamic_ds.get_item(i, 1)
        for key in BATCH_KEYS:  # static = dynamic frozen at epoch 0
            np.testing.assert_array_equal(e0[key], static_ds[i][key])
        for key in ("token_type_ids", "attention_mask", "next_sentence_label"):
            np.testing.assert_array_equal(e0[key], e1[key])
        np.testing.assert_array_equal(dynamic_ds.get_item(i, 1)["input_ids"], e1["input_ids"])
        changed += not np.array_equal(e0["masked_lm_positions"], e1["masked_lm_positions"])
    assert changed > 0.9 * len(range(0, len(dynamic_ds), 37))


def test_samples_never_mask_special_tokens_or_padding(tokenizer, dynamic_ds):
    specials = tokenizer.all_special_ids
    for i in range(0, len(dynamic_ds), 7):
        s = dynamic_ds.get_item(i, epoch=2)
        k = int((s["masked_lm_labels"] != IGNORE_INDEX).sum())
        assert 1 <= k <= 10
        pos = s["masked_lm_positions"][:k]
        assert np.all(s["attention_mask"][pos] == 1)
        assert not np.isin(s["masked_lm_labels"][:k], specials).any()
        assert np.all(s["input_ids"][s["attention_mask"] == 0] == tokenizer.pad_token_id)


def test_collate_builds_the_batch_dict(dynamic_ds):
    batch = collate_pretraining_batch([dynamic_ds[i] for i in range(5)])
    assert tuple(batch) == BATCH_KEYS == (
        "input_ids", "token_type_ids", "attention_mask", "masked_lm_positions", "masked_lm_labels",
        "next_sentence_label")
    assert all(t.dtype == torch.int64 for t in batch.values())
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        assert batch[key].shape == (5, 64)
    assert batch["masked_lm_positions"].shape == batch["masked_lm_labels"].shape == (5, 10)
    assert batch["next_sentence_label"].shape == (5,)
    # The model gathers P hidden states per row; the gathered ids are what the labels were corrupted from.
    gathered = torch.gather(batch["input_ids"], 1, batch["masked_lm_positions"])
    used = batch["masked_lm_labels"] != IGNORE_INDEX
    assert (gathered[~used] == dynamic_ds.instances[0].input_ids[0]).all()  # unused slots point at [CLS]
    assert (gathered[used] == MASK).float().mean() > 0.6


def test_empty_corpus_is_a_clear_error(tokenizer):
    from data.text.pretraining import build_pretraining_dataset

    with pytest.raises(ValueError, match="empty"):
        build_pretraining_dataset(tokenizer, [])
    with pytest.raises(ValueError, match="empty"):
        build_pretraining_dataset(tokenizer, [[], []])
    with pytest.raises(ValueError, match="masking"):
        build_pretraining_dataset(tokenizer, [["a b."], ["c d."]], masking="sometimes")
