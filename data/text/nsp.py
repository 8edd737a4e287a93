"""Sentence-pair instances for next-sentence prediction, with Google's ``create_pretraining_data`` semantics.

Per document, sentences are accumulated until a target length is reached (``max_seq_len - 3``, or with
probability ``short_seq_prob`` a random shorter target drawn once per document pass, as Google does). The
chunk is split into A and B at a random sentence boundary. Half of the time (and always when the chunk
holds a single sentence) B is replaced by a run of sentences from a random other document
(``is_random_next``), and the sentences of the chunk that B did not use are put back to be read again.
The pair is then truncated to ``max_seq_len - 3`` tokens by removing a token from the front or the back
(50/50) of the longer side until it fits. The whole corpus is passed ``dupe_factor`` times; documents are
shuffled first and instances last, as in the reference.

One deliberate difference: the random document is drawn uniformly among the *other* documents, instead
of Google's "retry up to 10 times" loop, which can still return the same document.

All randomness comes from the ``random.Random`` passed in; the global RNG is never used.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

NEXT_SENTENCE = 0  # B is the real continuation of A (Hugging Face BertForPreTraining's convention)
RANDOM_SENTENCE = 1  # B comes from another document


class PretrainingInstance(NamedTuple):
    """One unpadded pretraining example: ``[CLS] A [SEP] B [SEP]``.

    ``masked_lm_positions``/``masked_lm_labels`` are ``None`` until the instance is masked statically;
    once set they have the fixed size ``max_predictions`` (see :mod:`data.text.masking`) and ``input_ids``
    holds the corrupted tokens.
    """

    input_ids: np.ndarray  # [n] int64
    token_type_ids: np.ndarray  # [n] int64: 0 for [CLS] A [SEP], 1 for B [SEP]
    next_sentence_label: int  # NEXT_SENTENCE or RANDOM_SENTENCE
    masked_lm_positions: np.ndarray | None = None  # [P] int64
    masked_lm_labels: np.ndarray | None = None  # [P] int64


def _truncate_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random) -> None:
    """Drop tokens from the front or back (50/50) of the longer segment until the pair fits."""
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _pair_to_instance(tokens_a: list[int], tokens_b: list[int], is_random_next: bool,
                      cls_id: int, sep_id: int) -> PretrainingInstance:
    input_ids = np.array([cls_id, *tokens_a, sep_id, *tokens_b, sep_id], dtype=np.int64)
    token_type_ids = np.zeros(len(input_ids), dtype=np.int64)
    token_type_ids[len(tokens_a) + 2:] = 1
    label = RANDOM_SENTENCE if is_random_next else NEXT_SENTENCE
    return PretrainingInstance(input_ids, token_type_ids, label)


def _instances_from_document(documents: Sequence[Sequence[list[int]]], doc_index: int, max_num_tokens: int,
                             short_seq_prob: float, rng: random.Random, cls_id: int,
                             sep_id: int) -> list[PretrainingInstance]:
    document = documents[doc_index]
    target_len = max_num_tokens
    if rng.random() < short_seq_prob:
        target_len = rng.randint(2, max_num_tokens)

    instances = []
    chunk: list[list[int]] = []
    chunk_len = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        chunk_len += len(document[i])
        if i == len(document) - 1 or chunk_len >= target_len:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for segment in chunk[:a_end] for t in segment]
            tokens_b: list[int] = []
            is_random_next = len(chunk) == 1 or rng.random() < 0.5
            if is_random_next:
                target_b_len = target_len - len(tokens_a)
                other = rng.randrange(len(documents) - 1)
                if other >= doc_index:  # uniform over the other documents
                    other += 1
                random_doc = documents[other]
                for segment in random_doc[rng.randrange(len(random_doc)):]:
                    tokens_b.extend(segment)
                    if len(tokens_b) >= target_b_len:
                        break
                i -= len(chunk) - a_end  # put back the sentences B did not use
            else:
                tokens_b = [t for segment in chunk[a_end:] for t in segment]
            _truncate_pair(tokens_a, tokens_b, max_num_tokens, rng)
            instances.append(_pair_to_instance(tokens_a, tokens_b, is_random_next, cls_id, sep_id))
            chunk = []
            chunk_len = 0
        i += 1
    return instances


def create_nsp_instances(documents: Sequence[Sequence[Sequence[int]]], max_seq_len: int, rng: random.Random,
                         *, cls_id: int, sep_id: int, dupe_factor: int = 1,
                         short_seq_prob: float = 0.1) -> list[PretrainingInstance]:
    """Build unmasked ``[CLS] A [SEP] B [SEP]`` instances from tokenised documents.

    ``documents`` is a list of documents, each a list of sentences given as token ids (no special tokens).
    Empty sentences and documents are skipped; at least two non-empty documents are needed so that a
    random B can come from another document.
    """
    if max_seq_len < 5:
        raise ValueError(f"max_seq_len must be >= 5 to hold [CLS] A [SEP] B [SEP], got {max_seq_len}")
    if dupe_factor < 1:
        raise ValueError(f"dupe_factor must be >= 1, got {dupe_factor}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"short_seq_prob must be in [0, 1], got {short_seq_prob}")
    docs = [[list(s) for s in doc if len(s) > 0] for doc in documents]
    docs = [doc for doc in docs if doc]
    if len(docs) < 2:
        raise ValueError(
            f"next-sentence pairs need at least 2 non-empty documents, got {len(docs)} "
            f"(from {len(documents)} documents given)"
        )
    rng.shuffle(docs)

    max_num_tokens = max_seq_len - 3  # room for [CLS], [SEP], [SEP]
    instances = []
    for _ in range(dupe_factor):
        for doc_index in range(len(docs)):
            instances.extend(
                _instances_from_document(docs, doc_index, max_num_tokens, short_seq_prob, rng, cls_id, sep_id)
            )
    rng.shuffle(instances)
    return instances
