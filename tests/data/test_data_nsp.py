"""Vendored vocab, tokenizer, demo corpus and next-sentence-pair construction."""

import hashlib
import random

import numpy as np
import pytest

from data.text.demo_corpus import demo_documents, split_sentences
from data.text.nsp import NEXT_SENTENCE, RANDOM_SENTENCE, create_nsp_instances
from data.text.pretraining import tokenize_documents
from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_tokenizer

VOCAB_MD5 = "64800d5d8528ce344256daf115d4965e"
VOCAB_SIZE = 30522
CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def demo_token_docs(tokenizer):
    return tokenize_documents(tokenizer, demo_documents())


def test_vendored_vocab_is_bert_base_uncased():
    data = DEFAULT_VOCAB_PATH.read_bytes()
    assert hashlib.md5(data).hexdigest() == VOCAB_MD5
    assert data.count(b"\n") == VOCAB_SIZE


def test_tokenizer_is_lowercased_wordpiece(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.tokenize("Pretraining") == ["pre", "##train", "##ing"]
    assert (tokenizer.cls_token_id, tokenizer.sep_token_id) == (CLS, SEP)
    assert (tokenizer.mask_token_id, tokenizer.pad_token_id) == (103, 0)


def test_missing_vocab_names_the_path(tmp_path):
    missing = tmp_path / "no-such-vocab.txt"
    with pytest.raises(FileNotFoundError, match=r"no-such-vocab\.txt"):
        load_tokenizer(missing)


def test_demo_corpus_is_deterministic_prose():
    docs = demo_documents()
    assert docs == demo_documents()
    assert len(docs) >= 50  # 79 pydoc topics in CPython 3.11
    sentences = [s for doc in docs for s in doc]
    assert len(sentences) > 3000
    assert all(s and s == " ".join(s.split()) for s in sentences)
    assert not any(set(s) <= set("*=-+|~^ ") for s in sentences)  # underlines and table borders dropped


def test_sentence_rule_splits_prose_and_keeps_code_lines():
    text = (
        "Title\n*****\n\nFirst sentence, e.g. with an\nabbreviation. Second one? Yes!\n\n"
        'He said "stop." Then he left.\n\n'
        "   for x in range(3):\n       print(x)\n"
    )
    assert split_sentences(text) == [
        "Title",
        "First sentence, e.g. with an abbreviation.",
        "Second one?",
        "Yes!",
        'He said "stop."',
        "Then he left.",
        "for x in range(3):",
        "print(x)",
    ]


def _synthetic_docs(num_docs=30, seed=0):
    """Token t of sentence j of doc d is 1_000_000 + 1000 d + j, so every token names its source."""
    rng = random.Random(seed)
    return [[[1_000_000 + 1000 * d + j] * rng.randint(3, 25) for j in range(rng.randint(5, 40))]
            for d in range(num_docs)]


def _source(token):
    return divmod(token - 1_000_000, 1000)  # (document, sentence)


def _split_pair(inst):
    ids, types = inst.input_ids, inst.token_type_ids
    n_a = int((types == 0).sum())
    return ids[1:n_a - 1], ids[n_a:-1]


@pytest.mark.parametrize("max_seq_len", [32, 128])
def test_instances_have_bert_pair_format(demo_token_docs, max_seq_len):
    instances = create_nsp_instances(demo_token_docs, max_seq_len, random.Random(1), cls_id=CLS, sep_id=SEP)
    assert len(instances) > 100
    for inst in instances:
        ids, types = inst.input_ids, inst.token_type_ids
        assert ids.dtype == np.int64 and types.dtype == np.int64
        assert 5 <= len(ids) <= max_seq_len and len(types) == len(ids)
        n_a = int((types == 0).sum())
        # [CLS] A [SEP] has type 0, B [SEP] type 1, and the types never go back to 0.
        assert np.all(types[:n_a] == 0) and np.all(types[n_a:] == 1)
        assert ids[0] == CLS and ids[n_a - 1] == SEP and ids[-1] == SEP
        assert n_a >= 3 and len(ids) - n_a >= 2  # both segments non-empty
        assert np.count_nonzero(ids == CLS) == 1 and np.count_nonzero(ids == SEP) == 2
        assert inst.next_sentence_label in (NEXT_SENTENCE, RANDOM_SENTENCE)
        assert inst.masked_lm_positions is None


def test_most_instances_fill_the_sequence(demo_token_docs):
    instances = create_nsp_instances(demo_token_docs, 128, random.Random(2), cls_id=CLS, sep_id=SEP)
    lengths = np.array([len(inst.input_ids) for inst in instances])
    assert np.median(lengths) == 128  # targets are max_seq_len - 3 except short_seq_prob of the time
    assert np.mean(lengths < 64) < 0.25


def test_nsp_labels_are_balanced_and_mean_what_they_say():
    docs = _synthetic_docs()
    instances = create_nsp_instances(docs, 64, random.Random(3), cls_id=CLS, sep_id=SEP, dupe_factor=10)
    labels = np.array([inst.next_sentence_label for inst in instances])
    # 50% random by coin flip, plus the chunks with a single sentence, which are always random.
    assert 0.45 < labels.mean() < 0.6
    for inst in instances:
        a, b = _split_pair(inst)
        a_src = {_source(t) for t in a}
        b_src = {_source(t) for t in b}
        a_docs, b_docs = {d for d, _ in a_src}, {d for d, _ in b_src}
        assert len(a_docs) == 1 and len(b_docs) == 1
        if inst.next_sentence_label == NEXT_SENTENCE:  # B is the continuation of A in the same document
            assert a_docs == b_docs
            assert max(j for _, j in a_src) < min(j for _, j in b_src)
        else:  # B starts at a random sentence of another document
            assert a_docs != b_docs


def test_unused_sentences_are_put_back():
    docs = _synthetic_docs(seed=1)
    instances = create_nsp_instances(docs, 64, random.Random(4), cls_id=CLS, sep_id=SEP, short_seq_prob=0.0)
    covered = set()
    for inst in instances:
        a, b = _split_pair(inst)
        covered |= {_source(t) for t in a}
        if inst.next_sentence_label == NEXT_SENTENCE:
            covered |= {_source(t) for t in b}
    total = sum(len(doc) for doc in docs)
    # Without putting back the sentences a random B displaced, about a quarter would be lost.
    assert len(covered) / total > 0.95


def test_short_seq_prob_makes_shorter_targets():
    docs = _synthetic_docs(seed=2)
    full = create_nsp_instances(docs, 128, random.Random(5), cls_id=CLS, sep_id=SEP, short_seq_prob=0.0)
    short = create_nsp_instances(docs, 128, random.Random(5), cls_id=CLS, sep_id=SEP, short_seq_prob=1.0)
    assert np.mean([len(i.input_ids) for i in short]) < 0.8 * np.mean([len(i.input_ids) for i in full])


def test_truncation_respects_max_len_with_long_sentences():
    docs = [[[1_000_000 + 1000 * d + j] * 300 for j in range(3)] for d in range(4)]
    instances = create_nsp_instances(docs, 16, random.Random(6), cls_id=CLS, sep_id=SEP, dupe_factor=3)
    assert all(len(inst.input_ids) == 16 for inst in instances)


def test_same_seed_same_instances_and_different_seed_differs():
    docs = _synthetic_docs()

    def build(seed):
        return create_nsp_instances(docs, 64, random.Random(seed), cls_id=CLS, sep_id=SEP, dupe_factor=2)

    a, b, c = build(7), build(7), build(8)
    assert len(a) == len(b)
    assert all(np.array_equal(x.input_ids, y.input_ids) and x.next_sentence_label == y.next_sentence_label
               for x, y in zip(a, b, strict=True))
    assert len(a) != len(c) or any(
        not np.array_equal(x.input_ids, y.input_ids) for x, y in zip(a, c, strict=True))


def test_global_random_state_is_untouched():
    state = random.getstate()
    create_nsp_instances(_synthetic_docs(), 64, random.Random(0), cls_id=CLS, sep_id=SEP)
    assert random.getstate() == state


def test_dupe_factor_multiplies_instances():
    docs = _synthetic_docs()
    one = create_nsp_instances(docs, 64, random.Random(0), cls_id=CLS, sep_id=SEP, dupe_factor=1)
    five = create_nsp_instances(docs, 64, random.Random(0), cls_id=CLS, sep_id=SEP, dupe_factor=5)
    assert 4 * len(one) < len(five) < 6 * len(one)


@pytest.mark.parametrize("docs", [[], [[], []], [[[]], [[], []]], [[[5, 6], [7]]]])
def test_too_few_documents_is_a_clear_error(docs):
    with pytest.raises(ValueError, match="at least 2 non-empty documents"):
        create_nsp_instances(docs, 64, random.Random(0), cls_id=CLS, sep_id=SEP)


def test_bad_arguments_are_clear_errors():
    docs = _synthetic_docs()
    with pytest.raises(ValueError, match="max_seq_len"):
        create_nsp_instances(docs, 4, random.Random(0), cls_id=CLS, sep_id=SEP)
    with pytest.raises(ValueError, match="dupe_factor"):
        create_nsp_instances(docs, 64, random.Random(0), cls_id=CLS, sep_id=SEP, dupe_factor=0)
