"""Tiny BERTs for tests that need a real model but no config tree, and batches to train them on."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import BertConfig, BertForPreTraining, BertModel

# `create_model("bert_pretraining", **TINY_BERT)` is the model TINY's overrides compose.
TINY_BERT = dict(size="tiny", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`build()` under seed 0, without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


def tiny_bert_encoder() -> BertModel:
    """A one-layer BERT encoder of width 16: parameter groups of every kind (matrices, biases, LayerNorms)."""
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    return _seeded(lambda: BertModel(config))


def tiny_bert_for_pretraining() -> BertForPreTraining:
    """A two-layer BERT with its pretraining heads and no dropout: a loss that trains, deterministically."""
    config = BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _seeded(lambda: BertForPreTraining(config))


def pretraining_batches(n: int = 4, batch: int = 4, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """`n` fixed random batches for `tiny_bert_for_pretraining`, 15 % of the tokens labelled."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        input_ids = torch.randint(0, 1000, (batch, length), generator=g)
        masked = torch.rand(batch, length, generator=g) < 0.15
        out.append(dict(
            input_ids=input_ids,
            labels=torch.where(masked, input_ids, -100),
            next_sentence_label=torch.randint(0, 2, (batch,), generator=g),
        ))
    return out
