"""Evaluation shared by the ranks: each evaluates every world_size-th batch and the results are pooled in batch
order, so two ranks report exactly what one rank evaluating every batch reports."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from helpers.config import REPO
from helpers.distributed_harness import run_on_ranks
from torch import nn
from transformers import BertConfig, BertForQuestionAnswering

from data.images.transforms import EvalImages
from data.squad.features import SquadEvalData, build_features, load_squad
from data.text.tokenizer import load_tokenizer
from train.run_dir import RunDir
from train.tasks import EvalShard
from train.tasks.image_classification import evaluate_image_classification
from train.tasks.question_answering import evaluate_squad


class _Images(torch.utils.data.Dataset):
    """13 random 3x8x8 images in 7 classes: batches of 3 split 3 + 2 over two ranks, the last one short."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(13, 3, 8, 8, generator=generator)
        self.labels = torch.randint(0, 7, (13,), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"image": self.images[index], "label": self.labels[index]}


def _image_eval(shard: EvalShard) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 7)).eval()
    data = EvalImages(_Images(), batch_size=3, description="as is", protocol={"crop": 8.0})
    with torch.no_grad():
        return evaluate_image_classification(model, data, RunDir("unused"), shard)


def _squad_eval(shard: EvalShard, output_dir: Path) -> tuple[dict[str, float], dict[str, str]]:
    """Metrics and the files written, of a tiny untrained BERT on the demo questions (windows in batches of 3)."""
    tokenizer = load_tokenizer()
    examples = load_squad(REPO / "data" / "squad" / "squad_demo.json")
    features = build_features(examples, tokenizer, max_seq_len=64, doc_stride=24, max_query_len=16)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64)).eval()
    with torch.no_grad():
        metrics = evaluate_squad(model, SquadEvalData(examples, features, batch_size=3), RunDir(output_dir), shard)
    written = {p.name: p.read_text() for p in sorted(output_dir.glob("*.json"))} if output_dir.exists() else {}
    return metrics, written


def _alone_and_shared(rank: int, world_size: int, tmp_path: Path) -> dict:
    """Each task's evaluation by this rank alone (the world-size-1 path) and shared by the ranks."""
    return {
        "images": (_image_eval(EvalShard()), _image_eval(EvalShard(rank, world_size))),
        "squad": (_squad_eval(EvalShard(), tmp_path / f"alone_{rank}"),
                  _squad_eval(EvalShard(rank, world_size), tmp_path / f"shared_{rank}")),
    }


@functools.cache
def _ranks(tmp_path: Path) -> list[dict]:
    return run_on_ranks(_alone_and_shared, 2, tmp_path)


def test_this_ranks_batches_are_every_world_size_th():
    assert EvalShard(1, 2).batches(13, 3) == [[3, 4, 5], [9, 10, 11]]
    assert EvalShard(0, 2).batches(13, 3) == [[0, 1, 2], [6, 7, 8], [12]]
    assert EvalShard().batches(4, 3) == [[0, 1, 2], [3]]


@pytest.mark.slow
def test_two_ranks_report_exactly_the_image_metrics_of_one(tmp_path_factory):
    ranks = _ranks(tmp_path_factory.getbasetemp())
    alone, shared = ranks[0]["images"]
    assert shared == alone and alone["images"] == 13.0
    assert ranks[1]["images"][1] == alone  # every rank holds the pooled metrics


@pytest.mark.slow
def test_two_ranks_report_exactly_the_squad_scores_and_predictions_of_one(tmp_path_factory):
    ranks = _ranks(tmp_path_factory.getbasetemp())
    (alone, alone_files), (shared, shared_files) = ranks[0]["squad"]
    assert shared == alone and alone["windows"] > 3 * 2  # more than one batch per rank
    assert shared_files == alone_files and sorted(alone_files) == ["nbest_predictions.json", "predictions.json"]
    assert ranks[1]["squad"][1] == ({}, {})  # rank 1 predicts its windows; rank 0 scores and writes
