"""Real (non-pad) tokens beside sequences: the BERT task records the real tokens per sequence of every batch, the
console line turns them into tokens/s, and a training run's records carry them."""

from __future__ import annotations

import pytest
import torch
from helpers.config import TINY, compose

from models import create_model
from train.metrics import read_metrics, record_line
from train.run import run
from train.tasks import get_task


def test_the_bert_step_counts_the_real_tokens_of_its_rows():
    model = create_model("bert_pretraining", size="large", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)
    lengths = torch.tensor([16, 9, 4])
    mask = (torch.arange(16) < lengths[:, None]).long()
    batch = {"input_ids": torch.randint(1, 100, (3, 16)) * mask, "token_type_ids": torch.zeros(3, 16, dtype=torch.long),
             "attention_mask": mask, "masked_lm_positions": torch.tensor([[1, 2], [1, 3], [1, 2]]),
             "masked_lm_labels": torch.tensor([[5, 6], [7, -100], [8, 9]]),
             "next_sentence_label": torch.tensor([0, 1, 0])}
    out = get_task("bert_pretraining").step(model, batch)
    assert out["tokens_per_seq"].item() == pytest.approx(lengths.float().mean().item())


def test_the_console_line_shows_real_tokens_per_second():
    record = {"step": 3, "loss": 7.0, "seq_per_s": 100.0, "tokens_per_seq": 98.5, "elapsed": 1.0}
    assert "| 100.0 samples/s | 9850 tokens/s |" in record_line(record, 10)
    assert "tokens/s" not in record_line({k: v for k, v in record.items() if k != "tokens_per_seq"}, 10)


def test_a_training_run_records_real_tokens_per_sequence(tmp_path):
    run(compose([*TINY, "trainer.max_steps=2", "trainer.checkpoint_every=0"]), tmp_path)
    records = read_metrics(tmp_path)
    assert len(records) == 2
    assert all(0 < r["tokens_per_seq"] <= 32 for r in records)  # TINY's data.max_seq_len
