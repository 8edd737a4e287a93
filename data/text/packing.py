"""Sequence packing for BERT pretraining: several sequences per row of ``max_seq_len``, so phase 2 pads less.

The plan (:func:`plan_rows`) is best-fit decreasing on the sequences' lengths: longest first (ties in a seeded
order), each into the open row whose free space it fills most tightly, at most ``max_per_row`` sequences a row. It
is a pure function of the lengths and the seed, so every rank and every restart computes the same rows, and the
loader's position (a row index) means the same sequences after a resume. Sharded data is packed within each shard,
so the rows keep the shard-blocked reading order (:mod:`data.sampler`).

A packed row is one training sample. Its keys are those of an unpadded batch (:mod:`data.text.pretraining`), with:

======================  ========  ==========================================================================
key                     shape     meaning in a packed row
======================  ========  ==========================================================================
``attention_mask``      [B, L]    the sequence number of each token, 1..K; 0 for padding
``position_ids``        [B, L]    each sequence's positions, from 0 at its [CLS]
``masked_lm_positions`` [B, W]    every sequence's predicted positions, offset into the row; unused slots 0
``masked_lm_labels``    [B, W]    their original ids; unused slots -100
``next_sentence_label`` [B, K]    each sequence's NSP label; unused slots -100
``cls_positions``       [B, K]    where each sequence's [CLS] is (its NSP prediction is pooled there)
======================  ========  ==========================================================================

``K = max_per_row`` and ``W`` the most predictions ``K`` sequences of ``L`` tokens can hold (:func:`row_predictions`).
The model keeps attention within each sequence (a block-diagonal mask from ``attention_mask``), so a row's losses are
those of its sequences unpacked.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from data.text.masking import IGNORE_INDEX
from data.text.pretraining import PretrainingDataset, collate_pretraining_batch

PACKED_BATCH_KEYS = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "position_ids",
    "masked_lm_positions",
    "masked_lm_labels",
    "next_sentence_label",
    "cls_positions",
)
PACKING_TAG = 0x5041434B  # "PACK": keeps the plan's tie-breaking stream apart from the run's other seeded streams


def plan_rows(lengths: np.ndarray, capacity: int, max_per_row: int, seed: int, key: int = 0) -> list[list[int]]:
    """Rows of indices into ``lengths``: each index once, at most ``max_per_row`` a row, each row's lengths summing
    to at most ``capacity``. Best-fit decreasing, ties broken by a permutation seeded with ``(seed, key)``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"sequence lengths must lie in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, PACKING_TAG, key])))
    order = rng.permutation(len(lengths))
    order = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    row_free: list[int] = []
    # open_rows[free]: the rows with `free` positions left that may take another sequence; has_open mirrors it
    open_rows: list[list[int]] = [[] for _ in range(capacity + 1)]
    has_open = np.zeros(capacity + 1, dtype=bool)
    for index in order.tolist():
        length = int(lengths[index])
        fits = has_open[length:]
        if fits.any():
            free = length + int(fits.argmax())  # the tightest fit
            row = open_rows[free].pop()
            has_open[free] = bool(open_rows[free])
            rows[row].append(index)
        else:
            row, free = len(rows), capacity
            rows.append([index])
            row_free.append(capacity)
        row_free[row] = free - length
        if len(rows[row]) < max_per_row and row_free[row] > 0:
            open_rows[row_free[row]].append(row)
            has_open[row_free[row]] = True
    return rows


def row_predictions(max_seq_len: int, max_predictions: int, max_per_row: int, masked_lm_prob: float) -> int:
    """Prediction slots a row needs: each sequence predicts at most ``round(p · eligible)``, at least 1 (the masker's
    rule), so ``K`` sequences sharing ``L`` positions predict at most ``p · L + K``; never more than ``K · P``."""
    return min(max_per_row * max_predictions, math.floor(masked_lm_prob * max_seq_len) + max_per_row)


def _shard_lengths(instances: Sequence, shard_sizes: Sequence[int]) -> Iterator[np.ndarray]:
    """Each shard's sequence lengths: read from the shards themselves where they can say (:class:`ShardSet`)."""
    if hasattr(instances, "sequence_lengths"):
        yield from (instances.sequence_lengths(shard) for shard in range(len(shard_sizes)))
        return
    lengths = np.fromiter((len(inst.input_ids) for inst in instances), dtype=np.int64, count=len(instances))
    yield from np.split(lengths, np.cumsum(shard_sizes)[:-1])


class PackedPretrainingDataset(torch.utils.data.Dataset):
    """Rows of packed sequences over a :class:`PretrainingDataset` (keys: :data:`PACKED_BATCH_KEYS`).

    ``shard_sizes`` (sequences per shard; None: one shard) keeps every row within a shard; ``self.shard_sizes`` then
    holds the rows per shard, for the loader's shard-blocked order. Masks come from the wrapped dataset, per
    sequence index and epoch, so a sequence is masked the same packed or not.
    """

    def __init__(self, dataset: PretrainingDataset, max_per_row: int, seed: int,
                 shard_sizes: Sequence[int] | None = None) -> None:
        if max_per_row < 2:
            raise ValueError(f"max_per_row must be at least 2 to pack, got {max_per_row}")
        shard_sizes = list(shard_sizes or [len(dataset)])
        if sum(shard_sizes) != len(dataset):
            raise ValueError(f"shard_sizes sum to {sum(shard_sizes)}, not the dataset's {len(dataset)} sequences")
        if dataset.masker is None:
            raise ValueError("packing sizes a row's prediction slots by the masker's rule: the dataset has no masker")
        self.dataset = dataset
        self.max_per_row = max_per_row
        self.max_seq_len = dataset.max_seq_len
        self.predictions = row_predictions(dataset.max_seq_len, dataset.max_predictions, max_per_row,
                                           dataset.masker.masked_lm_prob)
        # The rows as two flat arrays (8 bytes per sequence and per row, whatever the corpus): row i holds the
        # sequences members[row_starts[i]:row_starts[i + 1]].
        members, row_sizes, self.shard_sizes = [], [], []
        self.tokens = 0  # real tokens of all rows
        start = 0
        for shard, lengths in enumerate(_shard_lengths(dataset.instances, shard_sizes)):
            rows = plan_rows(lengths, dataset.max_seq_len, max_per_row, seed, shard)
            members.append(start + np.fromiter(itertools.chain.from_iterable(rows), np.int64, len(lengths)))
            row_sizes.append(np.fromiter(map(len, rows), np.int64, len(rows)))
            self.shard_sizes.append(len(rows))
            self.tokens += int(lengths.sum())
            start += len(lengths)
        self.members = np.concatenate(members)
        self.row_starts = np.concatenate([[0], np.cumsum(np.concatenate(row_sizes))])

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def row(self, row: int) -> np.ndarray:
        """The sequence indices of row ``row``, in their order in the row."""
        return self.members[self.row_starts[row]:self.row_starts[row + 1]]

    @staticmethod
    def collate(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """Stack packed rows into the batch dict (int64 tensors, keys :data:`PACKED_BATCH_KEYS`)."""
        return collate_pretraining_batch(samples, PACKED_BATCH_KEYS)

    def __getitem__(self, row: int) -> dict[str, np.ndarray]:
        return self.get_item(row, epoch=0)

    def get_item(self, row: int, epoch: int) -> dict[str, np.ndarray]:
        """Row ``row`` as seen in ``epoch``: its sequences one after another, then padding."""
        length, slots = self.max_seq_len, self.predictions
        out = {
            "input_ids": np.full(length, self.dataset.pad_token_id, dtype=np.int64),
            "token_type_ids": np.zeros(length, dtype=np.int64),
            "attention_mask": np.zeros(length, dtype=np.int64),
            "position_ids": np.zeros(length, dtype=np.int64),
            "masked_lm_positions": np.zeros(slots, dtype=np.int64),
            "masked_lm_labels": np.full(slots, IGNORE_INDEX, dtype=np.int64),
            "next_sentence_label": np.full(self.max_per_row, IGNORE_INDEX, dtype=np.int64),
            "cls_positions": np.zeros(self.max_per_row, dtype=np.int64),
        }
        start = used = 0
        for number, index in enumerate(self.row(row).tolist()):
            inst = self.dataset.masked_instance(index, epoch)
            end = start + len(inst.input_ids)
            out["input_ids"][start:end] = inst.input_ids
            out["token_type_ids"][start:end] = inst.token_type_ids
            out["attention_mask"][start:end] = number + 1
            out["position_ids"][start:end] = np.arange(end - start)
            predicted = inst.masked_lm_labels != IGNORE_INDEX
            count = int(predicted.sum())
            if used + count > slots:
                raise ValueError(f"row {row} holds {used + count} predictions, more than its {slots} slots: the "
                                 "masks predict more than the masker's rule allows")
            out["masked_lm_positions"][used:used + count] = inst.masked_lm_positions[predicted] + start
            out["masked_lm_labels"][used:used + count] = inst.masked_lm_labels[predicted]
            out["next_sentence_label"][number] = inst.next_sentence_label
            out["cls_positions"][number] = start
            start, used = end, used + count
        return out

    @property
    def description(self) -> str:
        """For the run's start-up lines: what a sample is and how much of it is padding."""
        return (f"packed: {len(self.dataset):,} sequences in {len(self):,} rows of at most {self.max_per_row} "
                f"(padding {self.padding:.1%})")

    @property
    def padding(self) -> float:
        """The share of the rows' positions that hold no token."""
        return 1 - self.tokens / (len(self) * self.max_seq_len)
