"""JointSpar in the trainer: its layers over BERT, the eager-mode config check, and a 2-rank run that learns and logs
the bytes of the layers it drew."""

from __future__ import annotations

import pytest
import torch
from helpers.config import TINY, compose
from helpers.runs import run_train

from core.errors import ConfigError
from optim import build_optimizer
from optim._math import mask_seed
from optim.jointspar import systematic_sample
from train.config import validate
from train.metrics import read_metrics
from train.model_init import build_model


def test_compile_is_a_config_error():
    with pytest.raises(ConfigError, match=r"trainer.compile=true with optim=jointspar"):
        validate(compose(["optim=jointspar", "trainer.compile=true", "trainer.device=cpu"]))


def test_the_trainer_builds_it_over_named_layers_of_bert():
    cfg = compose([*TINY, "optim=jointspar"])
    model = build_model(cfg.model.name, validate(cfg).model_options, None, None)
    options = {key: value for key, value in cfg.optim.items() if key != "name"}
    optimizer = build_optimizer(model, "jointspar", options)
    names = [layer.name for layer in optimizer.layers]
    assert names == ["bert.embeddings", "bert.encoder.layer.0", "bert.pooler", "cls.predictions",
                     "cls.seq_relationship"]


@pytest.mark.slow
def test_two_workers_learn_and_log_the_bytes_of_the_drawn_layers(tmp_path):
    """eta_p = 0 keeps the probabilities uniform, so the layer sets can be redrawn here and their bytes compared
    with the logged ones."""
    result = run_train([*TINY, "optim=jointspar", "optim.eta_p=0.0", "optim.sample_ratio=0.4", "optim.p_min=0.2",
                        "trainer.nproc_per_node=2", "trainer.max_steps=12", "trainer.log_every=3",
                        "trainer.checkpoint_every=0", "optim.lr=0.02", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    cfg = compose([*TINY, "optim=jointspar"])
    optimizer = build_optimizer(build_model(cfg.model.name, validate(cfg).model_options, None, None), "jointspar",
                                {"sample_ratio": 0.4, "p_min": 0.2, "eta_p": 0.0})
    sizes = torch.tensor([layer.numel for layer in optimizer.layers], dtype=torch.float64)
    sent = [4 * float(sizes[systematic_sample(optimizer.probabilities,
                                              torch.Generator().manual_seed(mask_seed(0, t)))].sum())
            for t in range(12)]
    assert [r["step"] for r in records] == [3, 6, 9, 12]
    for record in records:
        window = sent[record["step"] - 3 : record["step"]]
        assert record["comm_bytes_per_step"] == pytest.approx(sum(window) / 3, rel=1e-12)
        assert 0 < record["comm_bits_per_param"] < 32
    assert records[-1]["loss"] < records[0]["loss"]
