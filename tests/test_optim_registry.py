"""The optimizer registry against conf/optim/, build_optimizer's errors, and the weight-decay param groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from transformers import BertConfig, BertModel

from optim import (
    OptimSpec,
    _registry,
    build_optimizer,
    get_optimizer_spec,
    list_optimizers,
    param_groups_weight_decay,
    register_optimizer,
)

CONF_OPTIM = Path(__file__).resolve().parents[1] / "conf" / "optim"


def _tiny_bert() -> BertModel:
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BertModel(config)


def _config(name: str) -> dict:
    """The YAML as written (PyYAML is stricter than OmegaConf: `6e-3` would be a string), minus Hydra keys."""
    cfg = yaml.safe_load((CONF_OPTIM / f"{name}.yaml").read_text())
    cfg.pop("defaults", None)
    return cfg


def test_conf_optim_and_registry_match_one_to_one():
    assert sorted(path.stem for path in CONF_OPTIM.glob("*.yaml")) == list_optimizers()
    assert {"adamw", "lamb"} <= set(list_optimizers())


@pytest.mark.parametrize("name", list_optimizers())
def test_each_config_builds_its_optimizer_and_steps(name):
    cfg = _config(name)
    assert cfg.pop("name") == name
    for key in ("lr", "eps", "weight_decay"):
        assert isinstance(cfg[key], float), f"conf/optim/{name}.yaml: {key}={cfg[key]!r} is not a float"
    spec = get_optimizer_spec(name)
    model = _tiny_bert()
    optimizer = build_optimizer(model, name, cfg)
    assert isinstance(optimizer, spec.cls) and spec.grad_sync in ("ddp", "self") and spec.description
    decay = next(g for g in optimizer.param_groups if g["name"] == "decay")
    assert decay["weight_decay"] == cfg["weight_decay"]
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).last_hidden_state.square().mean().backward()
    optimizer.step()
    optimizer.step()  # DeepSpeed's 1-bit family leaves the weights alone on its first step (onebit spec, Q1)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_lamb_config_leaves_clipping_to_the_trainer():
    optimizer = build_optimizer(_tiny_bert(), "lamb", {k: v for k, v in _config("lamb").items() if k != "name"})
    assert optimizer.defaults["max_grad_norm"] is None  # null is passed on, not replaced by the class default
    assert optimizer.defaults["betas"] == (0.9, 0.999)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError, match="unknown optimizer 'sgdx'; known optimizers: adamw, lamb") as info:
        get_optimizer_spec("sgdx")
    assert all(name in str(info.value) for name in list_optimizers())
    with pytest.raises(ValueError, match="known optimizers"):
        build_optimizer(_tiny_bert(), "nope", {})


@pytest.mark.parametrize("key", ["momentum", "params", "comm"])
def test_unknown_option_names_optimizer_and_key(key):
    with pytest.raises(ValueError, match=f"'{key}' is not an option of optimizer 'lamb'; options: lr, betas"):
        build_optimizer(_tiny_bert(), "lamb", {"lr": 1e-3, key: 0.9})


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="'lamb' is registered twice"):
        register_optimizer(OptimSpec("lamb", torch.optim.SGD, "ddp", "again"))


class _SelfSyncing(torch.optim.SGD):
    def __init__(self, params, lr=0.1, weight_decay=0.0, comm=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.comm = comm


def test_self_syncing_optimizers_get_comm(monkeypatch):
    spec = OptimSpec("self_sync_test", _SelfSyncing, "self", "test only")
    monkeypatch.setitem(_registry._OPTIMIZERS, spec.name, spec)  # removed again after the test
    comm = object()
    assert build_optimizer(_tiny_bert(), spec.name, {"lr": 0.5}, comm=comm).comm is comm
    assert not hasattr(build_optimizer(_tiny_bert(), "adamw", {}, comm=comm), "comm")


def test_param_groups_cover_every_parameter_once_and_exempt_layernorm_and_bias():
    model = _tiny_bert()
    model.embeddings.token_type_embeddings.weight.requires_grad_(False)
    groups = param_groups_weight_decay(model, 0.01)
    assert [(g["name"], g["weight_decay"]) for g in groups] == [("decay", 0.01), ("no_decay", 0.0)]
    grouped = [p for g in groups for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(trainable) == len({id(p) for p in grouped})
    assert {id(p) for p in grouped} == {id(p) for p in trainable}
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert all("LayerNorm" in n or n.endswith(".bias") for n in no_decay)
    assert {"embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias", "pooler.dense.bias"} <= no_decay
    assert {"embeddings.word_embeddings.weight", "pooler.dense.weight"} <= decay
    assert all(model.get_parameter(n).ndim >= 2 for n in decay)
    assert "embeddings.token_type_embeddings.weight" not in decay | no_decay  # frozen


def test_param_groups_drop_empty_groups_and_honour_no_weight_decay():
    assert [g["name"] for g in param_groups_weight_decay(nn.LayerNorm(4), 0.01)] == ["no_decay"]

    class WithPositions(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos_embed = nn.Parameter(torch.zeros(1, 4, 8))
            self.proj = nn.Linear(8, 8, bias=False)

        def no_weight_decay(self):
            return {"pos_embed"}

    groups = param_groups_weight_decay(WithPositions(), 0.05)
    assert [len(g["params"]) for g in groups] == [1, 1]
    assert groups[1]["params"][0].shape == (1, 4, 8)
