"""The held-out (validation) split of BERT pretraining data: whole documents, held out before any NSP pair is made.

Rule (the same for the demo corpus and for `python -m data.prepare`): the held-out documents are the first D
documents of the document stream, D the smallest count such that, for every phase (max_seq_len / max_predictions),
the NSP instances made from those D documents with dupe_factor=1 number at least N (``heldout_sequences``); each
phase's held-out set is then its first N instances. The remaining documents are trained on, so no held-out sentence
is ever trained on (not even as a random next segment: those come from the training documents only).

The pairing (``random.Random``) and the masks (``masking_rng(seed, 0, i)``) of the held-out set use
:func:`heldout_seed` of the preparation seed (the demo: of :data:`DEMO_HELDOUT_SEED`), never the trainer's seed, and
the held-out set is always statically masked: runs with any ``trainer.seed`` or masking mode evaluate identical data.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data.corpus.sources import CorpusError
from data.text.masking import MLMMasker, masking_rng
from data.text.nsp import PretrainingInstance, create_nsp_instances
from data.text.pretraining import (
    STATIC_MASKING_EPOCH,
    PretrainingDataset,
    mask_instance,
    tokenize_documents,
)

HELDOUT_TAG = 0x48454C44  # "HELD": keeps the held-out stream apart from the chunk streams SeedSequence([seed, chunk])
DEMO_HELDOUT_SEED = 12345  # the demo's held-out set ignores the run's seed (create_pretraining_data's default seed)


def heldout_seed(seed: int) -> int:
    """The seed of the held-out pairing and masks: a function of the preparation seed only."""
    return int(np.random.SeedSequence([seed, HELDOUT_TAG]).generate_state(1)[0])


@dataclass(frozen=True)
class HeldOutText:
    """The held-out set as the task's evaluation consumes it (like :class:`data.images.transforms.EvalImages`)."""

    dataset: PretrainingDataset  # statically masked instances (or packed rows of them); the same on every rank
    batch_size: int
    documents: int  # D: the held-out documents, the first D of the document stream
    description: str  # "held-out: 256 sequences from the first 12 documents (seed ...)"

    def batches(self, batch_indices: list[list[int]] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """The whole set once, in order, or only the given batches of sample indices (one rank's share);
        batches are the dataset's `collate` of its samples."""
        if batch_indices is None:
            size = len(self.dataset)
            batch_indices = [list(range(i, min(i + self.batch_size, size))) for i in range(0, size, self.batch_size)]
        for indices in batch_indices:
            yield self.dataset.collate([self.dataset[i] for i in indices])


def heldout_text(instances: Sequence[PretrainingInstance], max_seq_len: int, max_predictions: int,
                 pad_token_id: int, batch_size: int, documents: int, seed: int) -> HeldOutText:
    """Wrap statically masked held-out instances for evaluation (no masker: their masks are fixed)."""
    dataset = PretrainingDataset(instances, max_seq_len, max_predictions, pad_token_id=pad_token_id)
    description = f"held-out: {len(instances)} sequences from the first {documents} documents (seed {seed})"
    return HeldOutText(dataset, batch_size, documents, description)


def select_heldout(documents: Iterable[list[list[int]]], phases: dict[str, tuple[int, int]], num_sequences: int,
                   seed: int, tokenizer, *, masked_lm_prob: float,
                   short_seq_prob: float) -> tuple[int, dict[str, list[PretrainingInstance]]]:
    """D and each phase's N masked held-out instances, taking tokenised documents from ``documents`` one by one.

    ``seed`` is the held-out seed (:func:`heldout_seed`); ``phases`` maps a name to (max_seq_len, max_predictions).
    Only as many documents are consumed as are held out. An instance uses at least one sentence of its own
    document, so counts below N sentences are skipped without building pairs.
    """
    taken: list[list[list[int]]] = []
    sentences = 0
    for document in documents:
        taken.append(document)
        sentences += sum(1 for sentence in document if sentence)
        if len(taken) < 2 or sentences < num_sequences:
            continue
        found = _phase_instances(taken, phases, num_sequences, seed, tokenizer, short_seq_prob)
        if found is not None:
            return len(taken), {name: _mask(instances, tokenizer, phases[name][1], masked_lm_prob, seed)
                                for name, instances in found.items()}
    if not taken:
        raise CorpusError("the corpus is empty: no document with text")
    if len(taken) < 2:
        raise CorpusError("the corpus has 1 document; next-sentence pairs need at least 2")
    raise CorpusError(f"heldout_sequences={num_sequences}: all {len(taken)} documents of the corpus make fewer "
                      "held-out sequences than that in some phase; lower heldout_sequences")


def _phase_instances(documents: list[list[list[int]]], phases: dict[str, tuple[int, int]], num_sequences: int,
                     seed: int, tokenizer, short_seq_prob: float) -> dict[str, list[PretrainingInstance]] | None:
    """Each phase's first N unmasked instances of these documents (dupe_factor=1), or None when one has fewer.

    Longest phases first: they make the fewest instances, so a too-small D fails there soonest.
    """
    found = {}
    for name, (max_seq_len, _) in sorted(phases.items(), key=lambda item: -item[1][0]):
        try:
            instances = create_nsp_instances(documents, max_seq_len, random.Random(seed), cls_id=tokenizer.cls_token_id,
                                             sep_id=tokenizer.sep_token_id, dupe_factor=1,
                                             short_seq_prob=short_seq_prob)
        except ValueError:  # fewer than 2 non-empty documents so far
            return None
        if len(instances) < num_sequences:
            return None
        found[name] = instances[:num_sequences]
    return {name: found[name] for name in phases}


def _mask(instances: list[PretrainingInstance], tokenizer, max_predictions: int, masked_lm_prob: float,
          seed: int) -> list[PretrainingInstance]:
    """Static masks, whatever the training masking: the held-out loss must not depend on the epoch or run."""
    masker = MLMMasker.from_tokenizer(tokenizer, masked_lm_prob=masked_lm_prob, max_predictions=max_predictions)
    return [mask_instance(inst, masker, masking_rng(seed, STATIC_MASKING_EPOCH, i)) for i, inst in enumerate(instances)]


def check_training_documents(remaining: int, held_out: int, num_sequences: int) -> None:
    """Refuse a held-out split that leaves fewer than 2 documents to train on (NSP needs two)."""
    if remaining < 2:
        raise CorpusError(f"heldout_sequences={num_sequences} holds out {held_out} documents and leaves "
                          f"{remaining} to train on (next-sentence pairs need 2); lower heldout_sequences")


def split_demo_documents(tokenizer, documents: list[list[str]], num_sequences: int, batch_size: int, *,
                         max_seq_len: int, max_predictions: int, masked_lm_prob: float,
                         short_seq_prob: float) -> tuple[HeldOutText, list[list[str]]]:
    """The demo corpus's held-out set (seed :data:`DEMO_HELDOUT_SEED`) and the documents left to train on."""
    seed = heldout_seed(DEMO_HELDOUT_SEED)
    tokens = (tokenize_documents(tokenizer, [document])[0] for document in documents)
    count, sets = select_heldout(tokens, {"demo": (max_seq_len, max_predictions)}, num_sequences, seed, tokenizer,
                                 masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob)
    check_training_documents(len(documents) - count, count, num_sequences)
    held_out = heldout_text(sets["demo"], max_seq_len, max_predictions, tokenizer.pad_token_id, batch_size, count,
                            seed)
    return held_out, documents[count:]
