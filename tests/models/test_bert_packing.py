"""Packed BERT batches: the loss and gradients of packed rows equal those of the same sequences unpacked, and no
attention crosses from one packed sequence to another."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.text.masking import MLMMasker
from data.text.nsp import PretrainingInstance
from data.text.packing import PackedPretrainingDataset
from data.text.pretraining import PretrainingDataset
from models import create_model
from train.tasks.bert_pretraining import bert_pretraining_step

VOCAB, LENGTH = 1000, 48
MASKER = MLMMasker(vocab_size=VOCAB, mask_token_id=3, special_token_ids=(0, 1, 2), max_predictions=8)


def _model(attn_implementation: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    model = create_model("bert_pretraining", size="tiny", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=LENGTH,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model.config._attn_implementation = attn_implementation
    return model.train()


def _datasets(count: int = 24) -> tuple[PretrainingDataset, PackedPretrainingDataset]:
    rng = np.random.default_rng(0)
    instances = []
    for _ in range(count):
        n = int(rng.integers(6, LENGTH + 1))
        a = int(rng.integers(1, n - 3))
        ids = np.concatenate([[1], rng.integers(10, VOCAB, a), [2], rng.integers(10, VOCAB, n - a - 3), [2]])
        types = (np.arange(n) >= a + 2).astype(np.int64)
        instances.append(PretrainingInstance(ids.astype(np.int64), types, int(rng.integers(0, 2))))
    plain = PretrainingDataset(instances, LENGTH, MASKER.max_predictions, masker=MASKER, seed=3)
    return plain, PackedPretrainingDataset(plain, 3, seed=0)


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list]:
    model.zero_grad(set_to_none=True)
    out = bert_pretraining_step(model, batch)
    out["loss"].backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_packed_batch_has_the_loss_and_gradients_of_its_sequences_unpacked(attn_implementation):
    plain, packed = _datasets()
    rows = range(len(packed))
    packed_batch = packed.collate([packed[row] for row in rows])
    indices = np.concatenate([packed.row(row) for row in rows]).tolist()
    assert len(indices) > len(rows)  # some rows hold several sequences
    plain_batch = plain.collate([plain[i] for i in indices])
    model = _model(attn_implementation)
    unpacked, unpacked_grads = _step(model, plain_batch)
    packed_out, packed_grads = _step(model, packed_batch)
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy"):
        torch.testing.assert_close(packed_out[key], unpacked[key], rtol=1e-5, atol=1e-6, msg=key)
    # real tokens per sample: a row carries the tokens of its sequences
    torch.testing.assert_close(packed_out["tokens_per_seq"] * len(rows), unpacked["tokens_per_seq"] * len(indices))
    assert packed_out["sequences_per_row"].item() == pytest.approx(len(indices) / len(rows))
    for (name, _), a, b in zip(model.named_parameters(), packed_grads, unpacked_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_evaluating_packed_rows_gives_the_metrics_of_their_sequences_unpacked():
    from data.text.heldout import HeldOutText
    from train.tasks import get_task
    from train.tasks._registry import ONE_RANK

    plain, packed = _datasets()
    model = _model().eval()
    with torch.no_grad():
        metrics = [get_task("bert_pretraining").evaluate(model, HeldOutText(data, 5, 1, ""), None, ONE_RANK)
                   for data in (plain, packed)]
    assert metrics[0].keys() == metrics[1].keys() and metrics[1]["sequences"] == len(plain)
    for key, value in metrics[0].items():
        assert metrics[1][key] == pytest.approx(value, rel=1e-5), key


def test_no_attention_crosses_packed_sequences():
    _, packed = _datasets()
    row = next(r for r in range(len(packed)) if len(packed.row(r)) >= 2)
    batch = packed.collate([packed[row]])
    changed = {key: value.clone() for key, value in batch.items()}
    second = batch["attention_mask"][0] == 2
    changed["input_ids"][0, second] = torch.randint(10, VOCAB, (int(second.sum()),))  # another second sequence
    model = _model().eval()
    with torch.no_grad():
        hidden = [model.bert(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                             attention_mask=_mask(b), position_ids=b["position_ids"])[0] for b in (batch, changed)]
        logits = [model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["masked_lm_positions"],
                        b["position_ids"], b["cls_positions"]) for b in (batch, changed)]
    first = batch["attention_mask"][0] == 1
    torch.testing.assert_close(hidden[0][0, first], hidden[1][0, first], rtol=0, atol=0)  # untouched, to the bit
    assert not torch.allclose(hidden[0][0, second], hidden[1][0, second])
    torch.testing.assert_close(logits[0][1][0, 0], logits[1][1][0, 0], rtol=0, atol=0)  # the first's NSP


def _mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from models._bert_heads import block_diagonal_mask

    return block_diagonal_mask(batch["attention_mask"], "sdpa", torch.float32)


def test_packed_batches_change_no_weight_names():
    """An export holds the parameters only, so the model that trains on packed rows exports as before."""
    from transformers import BertForPreTraining

    model = _model()
    assert set(model.state_dict()) == set(BertForPreTraining(model.config).state_dict())
