"""The BERT pretraining dataset (padded MLM + NSP samples), its batch collate, and the demo-corpus builder.

A sample is a dict of int64 numpy arrays and a batch the same keys stacked into torch int64 tensors:

======================  ========  ============================================================
key                     shape     meaning
======================  ========  ============================================================
``input_ids``           [B, L]    ``[CLS] A [SEP] B [SEP]`` after masking, padded with [PAD]
``token_type_ids``      [B, L]    0 for ``[CLS] A [SEP]`` and padding, 1 for ``B [SEP]``
``attention_mask``      [B, L]    1 for real tokens, 0 for padding
``masked_lm_positions`` [B, P]    positions of the predicted tokens, sorted; unused slots hold 0
``masked_lm_labels``    [B, P]    original ids at those positions; unused slots hold -100
``next_sentence_label`` [B]       0: B continues A, 1: B is random (BertForPreTraining's convention)
======================  ========  ============================================================

``P = max_predictions`` is fixed, so the model can gather ``P`` hidden states per sequence for the MLM head
without a host sync; the labels' -100 slots are ignored by the loss.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from data.text.demo_corpus import demo_documents
from data.text.masking import MLMMasker, masking_rng
from data.text.nsp import PretrainingInstance, create_nsp_instances

BATCH_KEYS = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "masked_lm_positions",
    "masked_lm_labels",
    "next_sentence_label",
)

STATIC_MASKING_EPOCH = 0  # static masks are the dynamic masks of epoch 0, drawn once at build time


class PretrainingDataset(torch.utils.data.Dataset):
    """Map-style dataset over any indexable collection of :class:`PretrainingInstance`.

    Instances that carry ``masked_lm_positions`` are statically masked and returned as stored. The others
    are masked on the fly by ``masker`` with the generator ``masking_rng(seed, epoch, index)``; the loader
    passes the epoch through :meth:`get_item` (plain ``dataset[index]`` means epoch 0).
    """

    def __init__(self, instances: Sequence[PretrainingInstance], max_seq_len: int, max_predictions: int,
                 *, masker: MLMMasker | None = None, seed: int = 0, pad_token_id: int = 0) -> None:
        if len(instances) == 0:
            raise ValueError("PretrainingDataset needs at least one instance, got an empty collection")
        if masker is not None and masker.max_predictions != max_predictions:
            raise ValueError(
                f"masker.max_predictions={masker.max_predictions} differs from "
                f"max_predictions={max_predictions}"
            )
        self.instances = instances
        self.max_seq_len = max_seq_len
        self.max_predictions = max_predictions
        self.masker = masker
        self.seed = seed
        self.pad_token_id = pad_token_id

    def __len__(self) -> int:
        return len(self.instances)

    @staticmethod
    def collate(samples: Sequence[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
        """The batch collate of these samples: what a loader over this dataset stacks with by default."""
        return collate_pretraining_batch(samples)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.get_item(index, epoch=0)

    def masked_instance(self, index: int, epoch: int) -> PretrainingInstance:
        """Instance ``index`` with the masks it has in ``epoch``, unpadded (packing places it in a row itself)."""
        inst = self.instances[index]
        n = len(inst.input_ids)
        if n > self.max_seq_len:
            raise ValueError(f"instance {index} has {n} tokens, more than max_seq_len={self.max_seq_len}")
        if inst.masked_lm_positions is None:
            if self.masker is None:
                raise ValueError(f"instance {index} is not masked and the dataset has no masker")
            inst = mask_instance(inst, self.masker, masking_rng(self.seed, epoch, index))
        if len(inst.masked_lm_positions) != self.max_predictions:
            raise ValueError(
                f"instance {index} has {len(inst.masked_lm_positions)} prediction slots, "
                f"expected max_predictions={self.max_predictions}"
            )
        return inst

    def get_item(self, index: int, epoch: int) -> dict[str, np.ndarray]:
        """The padded sample ``index`` as seen in ``epoch`` (only dynamic masks depend on the epoch)."""
        inst = self.masked_instance(index, epoch)
        n = len(inst.input_ids)
        input_ids = np.full(self.max_seq_len, self.pad_token_id, dtype=np.int64)
        token_type_ids = np.zeros(self.max_seq_len, dtype=np.int64)
        attention_mask = np.zeros(self.max_seq_len, dtype=np.int64)
        input_ids[:n] = inst.input_ids
        token_type_ids[:n] = inst.token_type_ids
        attention_mask[:n] = 1
        return {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "masked_lm_positions": np.asarray(inst.masked_lm_positions, dtype=np.int64),
            "masked_lm_labels": np.asarray(inst.masked_lm_labels, dtype=np.int64),
            "next_sentence_label": np.asarray(inst.next_sentence_label, dtype=np.int64),
        }


def mask_instance(instance: PretrainingInstance, masker: MLMMasker,
                  rng: np.random.Generator) -> PretrainingInstance:
    """Return ``instance`` with its MLM corruption and fixed-size prediction slots filled in."""
    masked = masker(instance.input_ids, rng)
    return instance._replace(
        input_ids=masked.input_ids,
        masked_lm_positions=masked.masked_lm_positions,
        masked_lm_labels=masked.masked_lm_labels,
    )


def collate_pretraining_batch(samples: Sequence[dict[str, np.ndarray]],
                              keys: Sequence[str] = BATCH_KEYS) -> dict[str, torch.Tensor]:
    """Stack samples into the batch dict (int64 tensors, keys :data:`BATCH_KEYS`, or a packed row's)."""
    return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64, copy=False)) for key in keys}


def tokenize_documents(tokenizer, documents: Sequence[Sequence[str]]) -> list[list[list[int]]]:
    """Tokenise all sentences in one batched call (no special tokens); keeps the document structure."""
    flat = [sentence for doc in documents for sentence in doc]
    ids = tokenizer(flat, add_special_tokens=False, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
    out, start = [], 0
    for doc in documents:
        out.append(ids[start:start + len(doc)])
        start += len(doc)
    return out


def build_pretraining_dataset(tokenizer, documents: Sequence[Sequence[str]], *, max_seq_len: int = 128,
                              max_predictions: int = 20, dupe_factor: int = 5, seed: int = 12345,
                              masking: Literal["static", "dynamic"] = "static", masked_lm_prob: float = 0.15,
                              short_seq_prob: float = 0.1) -> PretrainingDataset:
    """Tokenise documents (lists of sentences), build NSP pairs, wrap them in a :class:`PretrainingDataset`.

    ``seed`` drives both the pair construction (``random.Random(seed)``) and the masks
    (``masking_rng(seed, epoch, index)``). With ``masking="static"`` every instance is masked once here,
    with the mask dynamic masking would draw in epoch 0; with ``"dynamic"`` each epoch draws fresh masks.
    """
    if masking not in ("static", "dynamic"):
        raise ValueError(f"masking must be 'static' or 'dynamic', got {masking!r}")
    if sum(len(doc) for doc in documents) == 0:
        raise ValueError(f"the corpus is empty: {len(documents)} documents with no sentences")
    masker = MLMMasker.from_tokenizer(tokenizer, masked_lm_prob=masked_lm_prob,
                                      max_predictions=max_predictions)
    instances = create_nsp_instances(
        tokenize_documents(tokenizer, documents), max_seq_len, random.Random(seed),
        cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id,
        dupe_factor=dupe_factor, short_seq_prob=short_seq_prob,
    )
    if masking == "static":
        instances = [mask_instance(inst, masker, masking_rng(seed, STATIC_MASKING_EPOCH, i))
                     for i, inst in enumerate(instances)]
    return PretrainingDataset(instances, max_seq_len, max_predictions, masker=masker, seed=seed,
                              pad_token_id=tokenizer.pad_token_id)


def build_demo_dataset(tokenizer, max_seq_len: int = 128, max_predictions: int = 20, dupe_factor: int = 5,
                       seed: int = 12345, masking: Literal["static", "dynamic"] = "static",
                       masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1) -> PretrainingDataset:
    """The pretraining dataset over the embedded pydoc corpus (:mod:`data.text.demo_corpus`); offline, seconds."""
    return build_pretraining_dataset(
        tokenizer, demo_documents(), max_seq_len=max_seq_len, max_predictions=max_predictions,
        dupe_factor=dupe_factor, seed=seed, masking=masking, masked_lm_prob=masked_lm_prob,
        short_seq_prob=short_seq_prob,
    )
