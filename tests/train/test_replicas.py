"""Evaluation and export between SLAMB's dense syncs read the replicas' average, and training goes on undisturbed."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers.config import TINY, compose
from helpers.distributed_harness import run_on_ranks

from optim.comm import Comm
from train.config import validate
from train.metrics import read_metrics
from train.model_init import build_model
from train.plan import plan_run
from train.run_dir import RunDir

# Two ranks, distinct data; SLAMB's dense average after step 1 only, so the run ends with drifted replicas.
RUN = [*TINY, "data.heldout_sequences=32", "optim=slamb", "optim.min_compress_numel=500", "optim.sync_interval=100",
       "trainer.max_steps=3", "trainer.nproc_per_node=2"]


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world_size: int, run_dir: str) -> dict:
    from train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(plan_run(compose(RUN), run_dir), Comm())
    agreed_at_start = trainer.agreed_weights().model is trainer.model
    trainer.fit()
    own = _params(trainer.model)
    average = _params(trainer.agreed_weights().model)
    after = _params(trainer.model)
    trainer.close()
    return {"agreed_at_start": agreed_at_start, "own": own, "average": average, "after": after}


@pytest.mark.slow  # two gloo ranks: the slow tier's
def test_between_syncs_the_run_evaluates_and_exports_the_replicas_average(tmp_path):
    ranks = run_on_ranks(_worker, 2, str(tmp_path))
    assert all(rank["agreed_at_start"] for rank in ranks)  # equal weights: evaluated as they are, no copy
    own0, own1 = ranks[0]["own"], ranks[1]["own"]
    assert any(not torch.equal(a, b) for a, b in zip(own0, own1, strict=True))  # the replicas drifted
    expected = [(a + b) / 2 for a, b in zip(own0, own1, strict=True)]
    for rank in ranks:
        for got, want in zip(rank["average"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
        for after, own in zip(rank["after"], rank["own"], strict=True):
            assert torch.equal(after, own)  # averaging a copy left training's replica as it was

    cfg = compose(RUN)
    options = validate(cfg).model_options
    exported = build_model(cfg.model.name, options, str(RunDir(tmp_path).export_dir), None)
    checkpointed = build_model(cfg.model.name, options, str(tmp_path), None)  # the run's checkpoint, per-rank files
    for model in (exported, checkpointed):
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-7)
    log = RunDir(tmp_path).log_file.read_text()
    averages = len(re.findall(r"eval at step \d+ \(the average of the 2 ranks' replicas, ", log))
    assert "eval at step 3 (the average of the 2 ranks' replicas, " in log
    # The averages' bytes (fp32, one all-reduce per evaluation) are counted on their own line, not in the steps'.
    summary = json.loads(RunDir(tmp_path).summary_file.read_text())
    num_params = sum(p.numel() for p in own0)
    assert averages >= 1 and summary["replica_average_bytes_total"] == averages * 4 * num_params
    assert summary["replica_average_bits_per_param_per_step"] == pytest.approx(32 * averages / summary["steps"])
    records = read_metrics(tmp_path)
    assert summary["bytes_total"] == max(r.get("comm_bytes_total", 0) for r in records)
