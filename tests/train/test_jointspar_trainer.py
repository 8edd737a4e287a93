"""JointSpar in the trainer: its layers over BERT, compiled by regions (and the config check where it cannot be), and a
2-rank run that learns and logs the bytes of the layers it drew."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers.config import NO_DROPOUT, TINY, compose
from helpers.runs import run_train

from core.errors import ConfigError
from optim import build_optimizer
from optim._math import mask_seed
from optim.jointspar import systematic_sample
from train.config import validate
from train.metrics import read_metrics
from train.model_init import build_model
from train.run import run


@pytest.mark.parametrize(("overrides", "why"), [
    (["experiment=jointspar_swin_demo"], "model.name=swin is compiled as a whole"),
    (["optim=jointspar", "optim.granularity=tensor"], "optim.granularity=tensor switches every tensor on its own"),
], ids=["whole model", "tensor granularity"])
def test_compile_where_a_graph_would_be_rebuilt_for_most_draws_is_a_config_error(overrides, why):
    with pytest.raises(ConfigError, match=rf"trainer.compile=true with optim=jointspar, .*{why}.*compile=false"):
        validate(compose([*overrides, "trainer.compile=true", "trainer.device=cpu"]))


@pytest.mark.slow
def test_bert_compiled_by_regions_trains_the_eager_series_without_compiling_each_draw_again(tmp_path):
    # 4 layers, half of them drawn each step: a graph per draw would pass dynamo's limit of 8 per function. Without
    # dropout (a compiled graph draws its own random numbers) the series agree to float rounding.
    overrides = [*TINY, *NO_DROPOUT, "optim=jointspar", "optim.sample_ratio=0.5", "optim.p_min=0.1",
                 "model.num_hidden_layers=4", "trainer.max_steps=8"]
    run(compose(overrides), tmp_path / "eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        run(compose([*overrides, "trainer.compile=true"]), tmp_path / "compiled")
    eager, compiled = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "compiled")
    assert len(compiled) == 8
    for ours, reference in zip(compiled, eager, strict=True):
        assert ours["loss"] == pytest.approx(reference["loss"], rel=1e-5)


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
