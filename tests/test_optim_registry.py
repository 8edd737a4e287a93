"""The optimizer registry against conf/optim/, its config checks, build_optimizer's errors, construction on the
meta device, and the weight-decay param groups."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from transformers import BertConfig, BertModel

from conf.checks import ConfigError, missing_nvidia_apex
from optim import (
    LAMB,
    OptimSpec,
    _registry,
    build_optimizer,
    check_optimizer_config,
    get_optimizer_spec,
    list_optimizers,
    param_groups_weight_decay,
    register_optimizer,
)
from optim.apex import APEX_OPTIMIZERS
from optim.onebit_adam import OneBitFamily
from optim.restart import restart_optimizer

CONF_OPTIM = Path(__file__).resolve().parents[1] / "conf" / "optim"
# NVIDIA apex's entries build only with apex and a GPU; elsewhere their one-line refusal is what is tested.
RUNNABLE_HERE = [name for name in list_optimizers()
                 if name not in APEX_OPTIMIZERS or missing_nvidia_apex("apex.optimizers", "amp_C") is None]


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


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_each_config_builds_its_optimizer_and_steps(name):
    cfg = _config(name)
    assert cfg.pop("name") == name
    for key in {"lr", "eps", "weight_decay"} & set(cfg):  # SGD-like optimizers (lars, slowmo) have no eps
        assert isinstance(cfg[key], float), f"conf/optim/{name}.yaml: {key}={cfg[key]!r} is not a float"
    spec = get_optimizer_spec(name)
    model = _tiny_bert()
    optimizer = build_optimizer(model, name, cfg)
    assert isinstance(optimizer, spec.cls) and spec.grad_sync in ("ddp", "self") and spec.description
    decay = next(g for g in optimizer.param_groups if g["name"] == "decay")
    assert decay["weight_decay"] == cfg["weight_decay"]
    before = [p.detach().clone() for p in model.parameters()]
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # DeepSpeed's 1-bit family leaves the weights alone on its first step
        optimizer.zero_grad()
        if spec.samples_layers:  # JointSpar: the step's layers are drawn before the forward pass
            optimizer.begin_step()
        model(input_ids=ids).last_hidden_state.square().mean().backward()
        optimizer.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_lamb_config_leaves_clipping_to_the_trainer():
    optimizer = build_optimizer(_tiny_bert(), "lamb", {k: v for k, v in _config("lamb").items() if k != "name"})
    assert optimizer.defaults["max_grad_norm"] is None  # null is passed on, not replaced by the class default
    assert optimizer.defaults["betas"] == (0.9, 0.999)


def test_unknown_name_lists_known_ones():
    known = "adamw, apex_adam, apex_lamb, jointspar, lamb"
    with pytest.raises(ValueError, match=f"unknown optimizer 'sgdx'; known optimizers: {known}") as info:
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
        register_optimizer(OptimSpec("lamb", torch.optim.SGD, "ddp", "again", check=lambda options: None))


class _SelfSyncing(torch.optim.SGD):
    def __init__(self, params, lr=0.1, weight_decay=0.0, comm=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.comm = comm


def test_self_syncing_optimizers_get_comm(monkeypatch):
    spec = OptimSpec("self_sync_test", _SelfSyncing, "self", "test only", check=lambda options: None)
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


# ------------------------------------------------------------------------------------------ config checks
def _no_check(options):
    return None


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_each_config_passes_its_check(name):
    cfg = _config(name)
    check_optimizer_config(cfg.pop("name"), cfg)


def _check_fails(name: str, overrides: dict) -> str:
    cfg = {k: v for k, v in _config(name).items() if k != "name"}
    with pytest.raises(ConfigError) as info:
        check_optimizer_config(name, {**cfg, **overrides})
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", RUNNABLE_HERE)
@pytest.mark.parametrize(
    ("overrides", "start"),
    [
        ({"lr": -1}, "optim.lr=-1 must be >= 0"),
        ({"betas": [0.9, 1.5]}, "optim.betas=[0.9, 1.5] must be"),
        ({"betas": [0.9]}, "optim.betas=[0.9] must be"),
        ({"eps": -1e-8}, "optim.eps=-1e-08 must be >= 0"),
        ({"weight_decay": -0.1}, "optim.weight_decay=-0.1 must be >= 0"),
        ({"momentum": 0.9}, "optim.momentum is not an option of optimizer"),
        ({"params": []}, "optim.params is not an option of optimizer"),
        ({"comm": None}, "optim.comm is not an option of optimizer"),
    ],
)
def test_bad_values_and_unknown_keys_fail_at_check_time_naming_the_key(name, overrides, start):
    (key,) = overrides
    takes_it = key in inspect.signature(get_optimizer_spec(name).cls).parameters and key not in _registry._RESERVED
    if ("is not an option" in start) == takes_it:  # betas of an SGD-like optimizer, LARS's own momentum
        pytest.skip(f"optimizer '{name}' {'takes' if takes_it else 'has no'} option {key}")
    assert _check_fails(name, overrides).startswith(start)


# One bad value per option beyond the Adam four; the constructor rejects it with the same check.
OWN_OPTIONS = [
    ("lamb", "max_grad_norm", 0.0),
    ("lamb", "bias_correction", "scalar"),
    ("lamb", "trust_clip", [0.01, 1000.0]),
    ("lamb", "always_adapt", "yes"),
    ("lamb", "foreach", "auto"),
    ("slamb", "compress_ratio", 0.0),
    ("slamb", "beta3", 1.5),
    ("slamb", "sync_interval", 0),
    ("slamb", "min_compress_numel", -1),
    ("slamb", "trust_ratio_bounds", [0.0, 10.0]),
    ("slamb", "trust_ratio_bounds", True),
    ("slamb", "mask", "topk"),
    ("slamb", "rescale", "max"),
    ("slamb", "bias_correction_form", True),
    ("slamb", "wd_in_trust_ratio", "no"),
    ("slamb", "stale_ratio_fallback", 0.5),
    ("slamb", "clamp_1d", 1.5),
    ("slamb", "always_adapt", "no"),
    ("slamb", "comm_dtype", "int8"),
    ("slamb", "freshness_dtype", "bf16"),
    ("slamb", "sync_offset", 2),
    ("slamb", "bucket_mb", 0),
    ("slamb", "seed", "x"),
    ("lars", "momentum", 1.0),
    ("lars", "trust_coefficient", 0.0),
    ("lars", "nesterov", "yes"),
    ("lars", "exclude_1d", 1),
    ("slowmo", "base", "slamb"),
    ("slowmo", "base_options", "momentum=0.9"),
    ("slowmo", "sync_interval", 0),
    ("slowmo", "slow_momentum", 1.0),
    ("slowmo", "slow_lr", 0.0),
    ("slowmo", "average_buffers", "no"),
    ("slowmo", "bucket_mb", 0),
    ("jointspar", "base", "adamw"),
    ("jointspar", "base_options", "momentum=0.9"),
    ("jointspar", "sample_ratio", 1.5),
    ("jointspar", "p_min", 0.0),
    ("jointspar", "eta_p", float("inf")),
    ("jointspar", "granularity", "row"),
    ("jointspar", "unsampled", "zero"),
    ("jointspar", "seed", -1),
    ("onebit_adam", "freeze_step", -1),
    ("onebit_adam", "bucketing", "flat_scaled"),
    ("onebit_adam", "init_noop_step", "yes"),
    ("onebit_adam", "mask_zero_variance", 0),
    ("onebit_adam", "dense_comm_dtype", "int8"),
    ("onebit_lamb", "freeze_step", 1.5),
    ("onebit_lamb", "bucketing", "flat"),
    ("onebit_lamb", "max_coeff", 0.001),
    ("onebit_lamb", "min_coeff", 0.0),
    ("onebit_lamb", "coeff_beta", 1.0),
    ("onebit_lamb", "factor_min", 0.0),
    ("onebit_lamb", "factor_max", 0.1),
    ("onebit_lamb", "init_noop_step", "no"),
    ("onebit_lamb", "factor_threshold", -0.1),
    ("onebit_lamb", "mask_zero_variance", None),
    ("onebit_lamb", "dense_comm_dtype", "fp8"),
    ("zero_one_adam", "var_freeze_step", -1),
    ("zero_one_adam", "var_update_scaler", 0),
    ("zero_one_adam", "local_step_scaler", 0),
    ("zero_one_adam", "local_step_clipper", 0),
    ("zero_one_adam", "bucketing", "per_chunk"),
    ("zero_one_adam", "init_noop_step", [True]),
    ("zero_one_adam", "mask_zero_variance", "true"),
    ("zero_one_adam", "dense_comm_dtype", 16),
]


@pytest.mark.parametrize(("name", "key", "value"), OWN_OPTIONS)
def test_each_own_option_is_checked_in_the_config_and_the_constructor_alike(name, key, value):
    assert _check_fails(name, {key: value}).startswith(f"optim.{key}=")
    cfg = {k: v for k, v in _config(name).items() if k != "name"}
    with pytest.raises(ValueError, match=f"^{get_optimizer_spec(name).cls.__name__}: {key}="):
        build_optimizer(_tiny_bert(), name, {**cfg, key: value})


def test_every_option_of_every_optimizer_is_exercised_by_a_bad_value():
    adam = {"lr", "betas", "eps", "weight_decay"}
    covered = {(name, key) for name, key, _ in OWN_OPTIONS}
    classes_seen = set()
    for name in list_optimizers():
        if name in ("adamw", *APEX_OPTIMIZERS):  # torch's and apex's own options are theirs to check
            continue
        if get_optimizer_spec(name).cls in classes_seen:  # another name of a class (slamb_v2_official)
            continue
        classes_seen.add(get_optimizer_spec(name).cls)
        keys = set(_config(name)) - {"name"} - adam
        assert keys == {key for n, key in covered if n == name}, name


@pytest.mark.parametrize(
    ("name", "overrides", "start"),
    [
        # the old clash: LAMB's bool `bias_correction` and `trust_clip` are not SLAMB's options
        ("slamb", {"bias_correction": True}, "optim.bias_correction is not an option of optimizer 'slamb'"),
        ("slamb", {"trust_clip": False}, "optim.trust_clip is not an option of optimizer 'slamb'"),
        ("lamb", {"trust_clip": [0.01, 1000.0]}, "optim.trust_clip=[0.01, 1000.0] must be true or false"),
        ("lamb", {"bias_correction": "scalar"}, "optim.bias_correction=scalar must be true or false"),
        ("lamb", {"bias_correction_form": "full"}, "optim.bias_correction_form is not an option of optimizer"),
    ],
)
def test_options_of_a_sibling_optimizer_fail_at_check_time(name, overrides, start):
    assert _check_fails(name, overrides).startswith(start)


def test_unknown_name_fails_at_check_time():
    known = "adamw, apex_adam, apex_lamb, jointspar, lamb"
    with pytest.raises(ConfigError, match=rf"^optim\.name=sgdx .*; known optimizers: {known}"):
        check_optimizer_config("sgdx", {})


def test_compose_time_validation_names_the_optimizer_key():
    from conftest import compose

    from train.config import ConfigError as TrainConfigError
    from train.config import validate

    for overrides, start in [
        (["optim=slamb", "+optim.bias_correction=true"], "optim.bias_correction is not an option"),
        (["optim=slamb", "optim.trust_ratio_bounds=[0,10]"], "optim.trust_ratio_bounds=[0, 10] must be"),
        (["optim=lamb", "optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be"),
        (["optim=onebit_adam", "optim.bucketing=flat"], "optim.bucketing='flat' must be one of"),
    ]:
        with pytest.raises(TrainConfigError) as info:
            validate(compose(overrides))
        assert str(info.value).startswith(start), overrides


# ------------------------------------------------------------------------------------------ entry defaults
def test_entry_defaults_apply_under_the_config(monkeypatch):
    monkeypatch.setattr(_registry, "_OPTIMIZERS", dict(_registry._OPTIMIZERS))  # restored after the test
    seen = []
    register_optimizer(OptimSpec("lambc_test", LAMB, "ddp", "LAMB with a clipped trust ratio", check=seen.append,
                                 defaults={"trust_clip": True, "eps": 1e-8}))
    spec = get_optimizer_spec("lambc_test")
    with pytest.raises(TypeError):
        spec.defaults["eps"] = 1.0  # frozen

    check_optimizer_config("lambc_test", {"eps": 1e-7})
    assert seen[-1]["trust_clip"] is True and seen[-1]["eps"] == 1e-7  # entry default, then config
    assert seen[-1]["max_grad_norm"] == 1.0 and seen[-1]["betas"] == (0.9, 0.999)  # class signature
    assert set(seen[-1]) == set(_registry._options(LAMB))

    optimizer = build_optimizer(_tiny_bert(), "lambc_test", {"lr": 0.5})
    assert optimizer.defaults["trust_clip"] is True and optimizer.defaults["eps"] == 1e-8
    optimizer = build_optimizer(_tiny_bert(), "lambc_test", {"trust_clip": False})
    assert optimizer.defaults["trust_clip"] is False  # the config wins

    with pytest.raises(ValueError, match="beta3 is not an option of optimizer 'bad_defaults_test'"):
        register_optimizer(OptimSpec("bad_defaults_test", LAMB, "ddp", "test only", check=_no_check,
                                     defaults={"beta3": 0.9}))


@pytest.mark.parametrize("name", list_optimizers())
def test_each_entry_declares_what_the_trainer_asks(name):
    """The trainer asks an optimizer only through its record; a class's own answer must be the one recorded."""
    spec = get_optimizer_spec(name)
    if spec.warmup_option is not None:
        assert spec.warmup_option in _registry._options(spec.cls)
    own_agreement = getattr(spec.cls, "replicas_agree_after", None)  # classes only: external ones have none
    assert spec.replicas_agree_after is (own_agreement or _registry.replicas_always_agree)
    own_restart = getattr(spec.cls, "restart", None)
    assert spec.restart is (own_restart or restart_optimizer)
    assert (spec.restart_refusal is not None) == (isinstance(spec.cls, type) and issubclass(spec.cls, OneBitFamily))


def test_only_the_one_bit_optimizers_warn_about_their_warm_up():
    warm_ups = {name: get_optimizer_spec(name).warmup_option for name in list_optimizers()}
    assert {name: option for name, option in warm_ups.items() if option} == {
        "onebit_adam": "freeze_step", "onebit_lamb": "freeze_step"}


def test_shipped_entries_carry_their_modules_check():
    for name in list_optimizers():
        spec = get_optimizer_spec(name)
        assert callable(spec.check) and dict(spec.defaults) == {}, name


# ------------------------------------------------------------------------------------------ meta device
class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 200)
        self.head = nn.Linear(200, 4)


def _tensors(value, seen: set[int]):
    """Every tensor reachable from an optimizer's attributes and state (lists, dicts, helper objects)."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in (*value.keys(), *value.values()):
            yield from _tensors(item, seen)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _tensors(item, seen)
    elif hasattr(value, "__dict__") and type(value).__module__.startswith("optim"):
        yield from _tensors(vars(value), seen)


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_each_optimizer_constructs_over_meta_parameters(name):
    with torch.device("meta"):
        model = _Small()
    cfg = {k: v for k, v in _config(name).items() if k != "name"}
    optimizer = build_optimizer(model, name, cfg)  # param_groups_weight_decay groups, the YAML values
    names = [g["name"] for g in optimizer.param_groups]  # JointSpar splits each group by layer
    assert list(dict.fromkeys(names)) == ["decay", "no_decay"]
    tensors = list(_tensors(vars(optimizer), set()))
    off_meta = [(t.device, tuple(t.shape)) for t in tensors if t.device.type != "meta"]
    assert tensors and not off_meta  # no real storage: no value was read, nothing was allocated


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU (or apex) gives")
@pytest.mark.parametrize("name", APEX_OPTIMIZERS)
def test_apex_entries_without_apex_are_one_config_error(name):
    message = _check_fails(name, {})
    assert message.startswith(f"optim.name={name} needs NVIDIA apex with its CUDA extensions and a GPU")
    assert "PyPI package 'apex' is unrelated" in message and message.endswith("here no CUDA device is visible")
