"""The BERT validation loss: one number per set of weights, whatever the batch size or the ranks sharing it, equal
to the masked-LM and NSP cross-entropies taken over the whole held-out set at once; a demo run reports it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.config import TINY, compose
from helpers.distributed_harness import run_on_ranks
from helpers.runs import run_train

from data import DataRequest, build_data
from optim.comm import Comm
from train.config import validate
from train.model_init import build_model
from train.run_dir import RunDir
from train.tasks import EvalShard
from train.tasks._registry import evaluate_model, get_task
from train.tasks.bert_pretraining import evaluate_bert_pretraining


def _model_and_heldout(batch_size: int):
    cfg = compose([*TINY, f"data.eval_batch_size={batch_size}", "data.heldout_sequences=40"])
    data = build_data(cfg.data, DataRequest(rank=0, world_size=1, micro_batch_size=4, seed=0))
    torch.manual_seed(0)
    model = build_model(cfg.model.name, validate(cfg).model_options, None, data.tokenizer).eval()
    return model, data.eval


def _at_once(model, heldout) -> dict[str, float]:
    """The losses over every held-out sequence in one forward: the definition the evaluation must meet."""
    batch = next(heldout.batches([list(range(len(heldout.dataset)))]))
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                         batch["masked_lm_positions"])
    mlm_loss = F.cross_entropy(mlm.flatten(0, 1), batch["masked_lm_labels"].flatten(), ignore_index=-100).item()
    nsp_loss = F.cross_entropy(nsp, batch["next_sentence_label"]).item()
    return {"loss": mlm_loss + nsp_loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss}


@pytest.mark.parametrize("batch_size", [3, 64])
def test_the_validation_loss_is_the_whole_sets_not_a_mean_of_batch_means(batch_size):
    model, heldout = _model_and_heldout(batch_size)
    metrics = evaluate_model(get_task("bert_pretraining"), model, heldout, RunDir("unused"), EvalShard(), "fp32",
                             torch.device("cpu"))
    expected = _at_once(model, heldout)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5), key
    assert metrics["sequences"] == 40 and 0 <= metrics["mlm_accuracy"] <= 1 and 0 <= metrics["nsp_accuracy"] <= 1


def _shared_evaluation(rank: int, world_size: int) -> dict[str, float]:
    model, heldout = _model_and_heldout(3)  # 40 sequences in 14 batches: ranks hold different counts
    with torch.no_grad():
        return evaluate_bert_pretraining(model, heldout, RunDir("unused"),
                                         EvalShard(rank, world_size, Comm().group))


@pytest.mark.slow  # two gloo ranks: the slow tier's
def test_ranks_sharing_the_evaluation_report_what_one_rank_alone_does():
    model, heldout = _model_and_heldout(3)
    with torch.no_grad():
        alone = evaluate_bert_pretraining(model, heldout, RunDir("unused"))
    for shared in run_on_ranks(_shared_evaluation, 2):
        assert shared == alone  # pooled in batch order: the same sums, to the bit


def test_a_demo_run_reports_its_validation_loss(tmp_path):
    assert compose([]).data.heldout_sequences == 256  # the demo's own split
    result = run_train([*TINY, "data.heldout_sequences=256", "trainer.max_steps=4", "trainer.eval_every=2",
                        f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(RunDir(tmp_path).summary_file.read_text())
    evals = [json.loads(line) for line in RunDir(tmp_path).metrics_file.read_text().splitlines()
             if "eval/loss" in line]
    assert [record["step"] for record in evals] == [2, 4]
    assert summary["validation_loss"] == summary["final"]["eval/loss"] == evals[-1]["eval/loss"]
    assert summary["best"]["eval/loss"] == min(record["eval/loss"] for record in evals)
