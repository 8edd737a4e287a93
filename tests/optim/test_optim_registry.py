"""The optimizer registry against conf/optim/ and docs/optimizers/, its config checks, build_optimizer's errors,
construction on the meta device, and the weight-decay param groups.

The checks every optimizer must pass are parametrized over the registry and read its preset, so an optimizer added
as docs/development.md says is checked with nothing added here (tests/integration/test_adding_an_optimizer.py holds
to that).
"""

from __future__ import annotations

import re

import pytest
import torch
import yaml
from helpers.config import REPO, optim_preset
from helpers.models import tiny_bert_encoder
from torch import nn

from core.errors import ConfigError
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
from optim.apex import APEX_OPTIMIZERS, runnable_optimizers
from optim.onebit_adam import OneBitFamily
from optim.restart import restart_optimizer

CONF_OPTIM = REPO / "conf" / "optim"
DOCS_OPTIMIZERS = REPO / "docs" / "optimizers"
RUNNABLE_HERE = runnable_optimizers()


@pytest.mark.parametrize("name", list_optimizers())
def test_each_optimizer_has_its_preset_under_its_name(name):
    preset = CONF_OPTIM / f"{name}.yaml"
    assert preset.is_file(), f"optimizer '{name}' has no conf/optim/{name}.yaml"
    assert yaml.safe_load(preset.read_text())["name"] == name


@pytest.mark.parametrize("preset", sorted(path.stem for path in CONF_OPTIM.glob("*.yaml")))
def test_each_preset_is_a_registered_optimizer(preset):
    assert preset in list_optimizers(), f"conf/optim/{preset}.yaml: no optimizer is registered as '{preset}'"


@pytest.mark.parametrize("name", list_optimizers())
def test_each_optimizer_has_a_docs_entry(name):
    named = re.compile(rf"`{re.escape(name)}`|optim={re.escape(name)}\b")
    assert any(named.search(page.read_text()) for page in DOCS_OPTIMIZERS.glob("*.md")), (
        f"no page under docs/optimizers/ names `{name}` or optim={name}")


@pytest.mark.parametrize("name", RUNNABLE_HERE)
def test_each_config_builds_its_optimizer_and_steps(name):
    cfg = optim_preset(name)
    for key in {"lr", "eps", "weight_decay"} & set(cfg):  # SGD-like optimizers (lars, slowmo) have no eps
        assert isinstance(cfg[key], float), f"conf/optim/{name}.yaml: {key}={cfg[key]!r} is not a float"
    spec = get_optimizer_spec(name)
    model = tiny_bert_encoder()
    optimizer = build_optimizer(model, name, cfg)
    assert not isinstance(spec.cls, type) or isinstance(optimizer, spec.cls)  # apex's entries build theirs late
    decay = next(g for g in optimizer.param_groups if g["name"] == "decay")
    assert decay["weight_decay"] == check_optimizer_config(name, cfg).get("weight_decay", 0.0)
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
    optimizer = build_optimizer(tiny_bert_encoder(), "lamb", optim_preset("lamb"))
    assert optimizer.defaults["max_grad_norm"] is None  # null is passed on, not replaced by the class default
    assert optimizer.defaults["betas"] == (0.9, 0.999)


def test_unknown_name_lists_known_ones():
    with pytest.raises(ValueError) as info:
        get_optimizer_spec("sgdx")
    assert str(info.value) == f"optim.name=sgdx must be one of {', '.join(list_optimizers())}"
    with pytest.raises(ValueError, match="must be one of adamw, "):
        build_optimizer(tiny_bert_encoder(), "nope", {})


@pytest.mark.parametrize("key", ["momentum", "params", "comm"])
def test_unknown_option_names_optimizer_and_key(key):
    with pytest.raises(ValueError, match=f"'{key}' is not an option of optimizer 'lamb'; options: lr, betas"):
        build_optimizer(tiny_bert_encoder(), "lamb", {"lr": 1e-3, key: 0.9})


def test_duplicate_registration_is_an_error():
    with pytest.raises(ValueError, match="'lamb' is registered twice"):
        register_optimizer(OptimSpec("lamb", torch.optim.SGD, "ddp", "again", check=lambda options: None))


class _SelfSyncing(torch.optim.SGD):
    def __init__(self, params, lr=0.1, weight_decay=0.0, comm=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.comm = comm


def test_self_syncing_optimizers_get_comm(monkeypatch):
    spec = OptimSpec("self_sync_test", _SelfSyncing, "self", "test only", check=lambda options: None)
    monkeypatch.setitem(_registry.OPTIMIZERS.entries, spec.name, spec)  # removed again after the test
    comm = object()
    assert build_optimizer(tiny_bert_encoder(), spec.name, {"lr": 0.5}, comm=comm).comm is comm
    assert not hasattr(build_optimizer(tiny_bert_encoder(), "adamw", {}, comm=comm), "comm")


def test_param_groups_cover_every_parameter_once_and_exempt_layernorm_and_bias():
    model = tiny_bert_encoder()
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
    check_optimizer_config(name, optim_preset(name))


def _check_fails(name: str, overrides: dict) -> str:
    with pytest.raises(ConfigError) as info:
        check_optimizer_config(name, {**optim_preset(name), **overrides})
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("name", RUNNABLE_HERE)
@pytest.mark.parametrize("key", ["momentum", "params", "comm"])
def test_unknown_keys_fail_at_check_time_naming_the_key(name, key):
    if key in _registry._options(get_optimizer_spec(name).cls):  # LARS's and SlowMo's own momentum
        pytest.skip(f"optimizer '{name}' takes option {key}")
    assert _check_fails(name, {key: 0.9}).startswith(f"optim.{key} is not an option of optimizer '{name}'")


# Values that no option accepts all of: an option whose check lets every one through is not checked.
PROBES = (-1, 0, 1.5, float("inf"), "not_a_value", [0.5], [0.5, 1.5])


def _runs_its_check(spec: OptimSpec) -> bool:
    """A class of this package runs its entry's check in its constructor (`run_check`), which names the class;
    a class from elsewhere (torch's AdamW, apex's builders) words its own errors."""
    return isinstance(spec.cls, type) and spec.cls.__module__.startswith("optim.")


@pytest.mark.parametrize(("name", "key"), [(name, key) for name in RUNNABLE_HERE for key in optim_preset(name)])
def test_each_option_is_checked_in_the_config_and_the_constructor_alike(name, key):
    """Each option of each preset refuses some of `PROBES` at check time, naming `optim.<key>=`; a direct build
    refuses each of those too, naming the class (`SLAMB: beta3=1.5 ...`): the config and a direct call agree."""
    preset = optim_preset(name)
    refused = []
    for value in PROBES:
        try:
            check_optimizer_config(name, {**preset, key: value})
        except ConfigError as err:
            if str(err).startswith(f"optim.{key}="):  # not a bound that names another option (max_coeff)
                refused.append(value)
    assert refused, f"optimizer '{name}' accepts {key}= each of {PROBES}: its check does not look at {key}"
    spec = get_optimizer_spec(name)
    if _runs_its_check(spec):
        model = tiny_bert_encoder()
        for value in refused:
            with pytest.raises(ValueError, match=f"^{spec.cls.__name__}: {key}="):
                build_optimizer(model, name, {**preset, key: value})


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
    with pytest.raises(ConfigError) as info:
        check_optimizer_config("sgdx", {})
    assert str(info.value) == f"optim.name=sgdx must be one of {', '.join(list_optimizers())}"


def test_compose_time_validation_names_the_optimizer_key():
    from helpers.config import compose

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
    monkeypatch.setattr(_registry.OPTIMIZERS, "_entries", dict(_registry.OPTIMIZERS.entries))  # restored after
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

    optimizer = build_optimizer(tiny_bert_encoder(), "lambc_test", {"lr": 0.5})
    assert optimizer.defaults["trust_clip"] is True and optimizer.defaults["eps"] == 1e-8
    optimizer = build_optimizer(tiny_bert_encoder(), "lambc_test", {"trust_clip": False})
    assert optimizer.defaults["trust_clip"] is False  # the config wins

    with pytest.raises(ValueError, match="beta3 is not an option of optimizer 'bad_defaults_test'"):
        register_optimizer(OptimSpec("bad_defaults_test", LAMB, "ddp", "test only", check=_no_check,
                                     defaults={"beta3": 0.9}))


@pytest.mark.parametrize("name", list_optimizers())
def test_each_entry_declares_what_the_trainer_asks(name):
    """The trainer asks an optimizer only through its record; a class's own answer must be the one recorded."""
    spec = get_optimizer_spec(name)
    assert callable(spec.check) and spec.description
    if spec.warmup_option is not None:
        assert spec.warmup_option in _registry._options(spec.cls)
    own_agreement = getattr(spec.cls, "replicas_agree_after", None)  # classes only: external ones have none
    assert spec.replicas_agree_after is (own_agreement or _registry.replicas_always_agree)
    own_restart = getattr(spec.cls, "restart", None)
    assert spec.restart is (own_restart or restart_optimizer)
    assert spec.restart_refusal is None or (spec.restart_refusal and "\n" not in spec.restart_refusal)


def _one_bit_family() -> list[str]:
    return [name for name in list_optimizers()
            if isinstance(cls := get_optimizer_spec(name).cls, type) and issubclass(cls, OneBitFamily)]


@pytest.mark.parametrize("name", _one_bit_family())
def test_the_one_bit_family_refuses_to_continue_another_runs_state(name):
    assert get_optimizer_spec(name).restart_refusal


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_the_one_bit_optimizers_warn_about_their_warm_up(name):
    assert get_optimizer_spec(name).warmup_option == "freeze_step"


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
    optimizer = build_optimizer(model, name, optim_preset(name))  # param_groups_weight_decay groups, the YAML values
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
