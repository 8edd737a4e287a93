"""LAMB: agreement with timm's Lamb on a tiny BERT, foreach == for-loop, trust-ratio fallbacks, exact resume."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from helpers.mlp import mlp_steps, small_mlp
from helpers.models import pretraining_batches, tiny_bert_for_pretraining
from helpers.round_trip import resumed_alongside
from helpers.threads import one_thread
from timm.optim import Lamb as TimmLamb
from torch import nn
from transformers import BertForPreTraining

from optim import LAMB, param_groups_weight_decay
from optim._math import FOREACH_CHUNK_NUMEL
from optim.flat import foreach_chunks

STEPS = 100
# Each config names the options that differ from NVLAMB's defaults; both optimizers get the same ones.
CONFIGS = {
    "nvlamb_clipped": dict(lr=6e-3, max_grad_norm=0.5),  # below every step's grad norm: clips each step
    "no_clip_adapt_all": dict(
        lr=2e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1, bias_correction=False, max_grad_norm=None,
        trust_clip=True, always_adapt=True,
    ),
    "partly_clipped": dict(lr=4e-3, weight_decay=0.0, max_grad_norm=3.0, trust_clip=True),
}


def _grad_norm(model: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


@functools.cache
def _train(impl: str, foreach: bool, config: str) -> tuple[BertForPreTraining, list[float]]:
    """Train the tiny BERT for STEPS steps (cached: each trajectory is computed once per session)."""
    model, batches = tiny_bert_for_pretraining(), pretraining_batches()
    cls = LAMB if impl == "ours" else TimmLamb
    optimizer = cls(param_groups_weight_decay(model, CONFIGS[config].get("weight_decay", 0.01)),
                    foreach=foreach, **CONFIGS[config])
    grad_norms = []
    with one_thread():
        for step in range(STEPS):
            model(**batches[step % len(batches)]).loss.backward()
            grad_norms.append(_grad_norm(model))
            optimizer.step()
            optimizer.zero_grad()
    return model, grad_norms


def _assert_same_params(a: nn.Module, b: nn.Module, atol: float, rtol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_timm_lamb_on_tiny_bert(config, foreach):
    ours, grad_norms = _train("ours", foreach, config)
    timm_model, _ = _train("timm", foreach, config)
    max_grad_norm = CONFIGS[config]["max_grad_norm"]
    if config == "nvlamb_clipped":
        assert min(grad_norms) > max_grad_norm  # pre-normalisation acted on every step
    elif config == "partly_clipped":
        assert min(grad_norms) < max_grad_norm < max(grad_norms)  # both branches of the clamp were taken
    _assert_same_params(ours, timm_model, atol=1e-5, rtol=1e-4)
    assert not torch.equal(ours.bert.pooler.dense.weight, tiny_bert_for_pretraining().bert.pooler.dense.weight)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_foreach_equals_for_loop(config):
    foreach, _ = _train("ours", True, config)
    for_loop, _ = _train("ours", False, config)
    # Same math, different rounding: foreach folds the bias corrections into scalars.
    _assert_same_params(foreach, for_loop, atol=1e-5, rtol=1e-4)


def test_chunked_foreach_equals_for_loop(monkeypatch):
    sizes = [4 * 4, 4, 7 * 3, 3, 200, 5]
    chunks = foreach_chunks([torch.empty(n) for n in sizes], max_numel=30)
    assert chunks == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6)]  # 200 > 30 goes alone
    monkeypatch.setitem(FOREACH_CHUNK_NUMEL, "cpu", 100)  # the small model in several chunks
    models = {}
    for foreach in (True, False):
        models[foreach] = model = small_mlp(8, 16, 4)
        optimizer = LAMB(param_groups_weight_decay(model, 0.01), lr=1e-2, max_grad_norm=0.05, foreach=foreach)
        mlp_steps(model, optimizer, range(5))
    _assert_same_params(models[True], models[False], atol=1e-6, rtol=1e-5)


def _one_step(param: torch.Tensor, grad: torch.Tensor, foreach: bool, **kwargs) -> torch.Tensor:
    p = nn.Parameter(param.clone())
    p.grad = grad.clone()
    LAMB([p], lr=0.1, max_grad_norm=None, foreach=foreach, **kwargs).step()
    return p.detach()


def _adam_update(grad: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return grad / (grad.abs() + eps)  # first step with bias correction: m_hat = g, v_hat = g^2


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_trust_ratio_fallbacks_and_no_decay_params(foreach):
    g = torch.Generator().manual_seed(2)
    grad, weight = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    # A zero-initialised weight has ||w|| = 0: ratio 1, a plain Adam step instead of none.
    zero = _one_step(torch.zeros(4, 3), grad, foreach, weight_decay=0.01)
    torch.testing.assert_close(zero, -0.1 * _adam_update(grad))
    # A zero gradient with no decay gives ||u|| = 0: ratio 1, no NaN, weight unchanged.
    still = _one_step(weight, torch.zeros(4, 3), foreach, weight_decay=0.0, always_adapt=True)
    torch.testing.assert_close(still, weight)
    # weight_decay = 0 (biases, LayerNorm): no trust ratio unless always_adapt.
    plain = _one_step(weight, grad, foreach, weight_decay=0.0)
    torch.testing.assert_close(plain, weight - 0.1 * _adam_update(grad))
    adapted = _one_step(weight, grad, foreach, weight_decay=0.0, always_adapt=True)
    update = _adam_update(grad)
    torch.testing.assert_close(adapted, weight - 0.1 * (weight.norm() / update.norm()) * update)
    # trust_clip caps the ratio at 1; here ||w|| / ||u|| is ~100.
    big = 100 * weight
    clipped = _one_step(big, grad, foreach, weight_decay=0.0, always_adapt=True, trust_clip=True)
    torch.testing.assert_close(clipped, big - 0.1 * update)


def test_pre_normalisation_leaves_grads_alone():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 10.0)
    LAMB([p], max_grad_norm=1.0).step()
    assert torch.equal(p.grad, torch.full((3,), 10.0))


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_state_dict_round_trip_continues_exactly(foreach):
    kwargs = dict(lr=1e-2, max_grad_norm=0.05, foreach=foreach)
    model, _, resumed, resumed_optimizer = resumed_alongside(
        lambda: small_mlp(8, 16, 4), lambda m: LAMB(param_groups_weight_decay(m, 0.01), **kwargs), range(5),
        range(5, 10))
    state = resumed_optimizer.state[resumed[0].weight]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"] == 10
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        (dict(lr=-1.0), "-1.0"),
        (dict(betas=(0.9, 1.5)), "1.5"),
        (dict(betas=(-0.1, 0.999)), "-0.1"),
        (dict(eps=-1e-6), "-1e-06"),
        (dict(weight_decay=-0.01), "-0.01"),
        (dict(max_grad_norm=0.0), "max_grad_norm=0.0"),
    ],
)
def test_bad_hyper_parameters_name_the_value(kwargs, value):
    with pytest.raises(ValueError, match=value.replace(".", r"\.").replace("(", r"\(")):
        LAMB([nn.Parameter(torch.ones(2))], **kwargs)


def test_max_grad_norm_is_optimizer_wide():
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.5 in a param group"):
        LAMB([{"params": [nn.Parameter(torch.ones(2))], "max_grad_norm": 0.5}], max_grad_norm=1.0)


def test_state_is_lazily_created_and_groups_without_grads_are_skipped():
    model = small_mlp(8, 16, 4)
    optimizer = LAMB(copy.deepcopy(param_groups_weight_decay(model, 0.01)))
    optimizer.step()  # no gradients yet: nothing happens
    assert not optimizer.state


# Parameters that get no gradient on some steps: the bias corrections use the group's step count (apex
# FusedLAMB), not the number of updates the tensor has received. Three groups with their own decay: one
# where some tensors have gradients from the start, one all of whose tensors start late.
LATE_START = 3  # steps without a gradient for the "late" tensors
LATE_STEPS = 8
LATE_SHAPES = {"w_always": (4, 3), "w_late": (3, 5), "b_always": (5,), "b_late": (3,), "x_late": (2, 2)}
LATE_GROUPS = [(["w_always", "w_late"], {}), (["b_always", "b_late"], {"weight_decay": 0.0}),
               (["x_late"], {"weight_decay": 0.1, "lr": 5e-3})]
LATE_CONFIGS = {
    "nvlamb_clipped": dict(lr=1e-2, max_grad_norm=0.5),  # every step's global norm is above 0.5
    "no_clip_adapt_all": dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.02, max_grad_norm=None,
                              trust_clip=True, always_adapt=True),
}


def _late_initial_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {name: torch.randn(shape, generator=g) for name, shape in LATE_SHAPES.items()}


def _late_grads(step: int) -> dict[str, torch.Tensor | None]:
    """Step `step`'s (0-based) gradients: None for the late tensors during the first LATE_START steps."""
    g = torch.Generator().manual_seed(100 + step)
    grads = {name: torch.randn(shape, generator=g) for name, shape in LATE_SHAPES.items()}
    return {name: None if name.endswith("_late") and step < LATE_START else grad for name, grad in grads.items()}


def _late_lamb(params: dict[str, nn.Parameter], config: str, foreach: bool) -> LAMB:
    groups = [{"params": [params[name] for name in names], **options} for names, options in LATE_GROUPS]
    return LAMB(groups, foreach=foreach, **LATE_CONFIGS[config])


def _late_steps(params: dict[str, nn.Parameter], optimizer: LAMB, steps: range) -> None:
    for step in steps:
        for name, grad in _late_grads(step).items():
            params[name].grad = grad
        optimizer.step()


def _apex_lamb_reference(config: str, steps: int) -> dict[str, torch.Tensor]:
    """apex FusedLAMB (use_nvlamb = always_adapt) transcribed from its definition, in float64, one tensor at
    a time: `group['step'] += 1` once per step for every group; tensors without a gradient are skipped."""
    options = {**dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                      max_grad_norm=1.0, trust_clip=False, always_adapt=False), **LATE_CONFIGS[config]}
    beta1, beta2 = options["betas"]
    weights = {name: w.double() for name, w in _late_initial_weights().items()}
    moments = {}
    group_steps = [0] * len(LATE_GROUPS)
    for step in range(steps):
        grads = {name: g.double() for name, g in _late_grads(step).items() if g is not None}
        clip = 1.0
        if options["max_grad_norm"] is not None:  # NVLAMB: divide by max(1, global norm / max_grad_norm)
            total = sum(g.square().sum() for g in grads.values()).sqrt().item()
            clip = max(1.0, total / options["max_grad_norm"])
        for i, (names, group_options) in enumerate(LATE_GROUPS):
            group = {**options, **group_options}
            group_steps[i] += 1
            t = group_steps[i]
            for name in names:
                if name not in grads:
                    continue
                g = grads[name] / clip
                m, v = moments.get(name, (torch.zeros_like(g), torch.zeros_like(g)))
                m = beta1 * m + (1 - beta1) * g
                v = beta2 * v + (1 - beta2) * g * g
                moments[name] = m, v
                if group["bias_correction"]:
                    m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
                else:
                    m_hat, v_hat = m, v
                w = weights[name]
                u = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * w
                ratio = 1.0
                if group["weight_decay"] != 0 or group["always_adapt"]:
                    w_norm, u_norm = w.norm().item(), u.norm().item()
                    if w_norm > 0 and u_norm > 0:
                        ratio = w_norm / u_norm
                    if group["trust_clip"]:
                        ratio = min(ratio, 1.0)
                weights[name] = w - group["lr"] * ratio * u
    return weights


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("config", list(LATE_CONFIGS))
def test_bias_correction_counts_steps_per_group_as_apex(config, foreach):
    params = {name: nn.Parameter(w) for name, w in _late_initial_weights().items()}
    optimizer = _late_lamb(params, config, foreach)
    _late_steps(params, optimizer, range(LATE_STEPS))
    expected = _apex_lamb_reference(config, LATE_STEPS)
    for name, p in params.items():
        torch.testing.assert_close(p.detach(), expected[name].float(), atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert not torch.equal(p.detach(), _late_initial_weights()[name])
    # Every group counted every step, the one without any gradient at first included; the tensors' own
    # `step` counts the updates each received.
    assert [group["step"] for group in optimizer.param_groups] == [LATE_STEPS] * len(LATE_GROUPS)
    for name, p in params.items():
        updates = LATE_STEPS - LATE_START if name.endswith("_late") else LATE_STEPS
        assert optimizer.state[p]["step"] == updates


def _late_checkpoint(foreach: bool) -> dict:
    params = {name: nn.Parameter(w) for name, w in _late_initial_weights().items()}
    optimizer = _late_lamb(params, "nvlamb_clipped", foreach)
    _late_steps(params, optimizer, range(LATE_START + 2))
    buffer = io.BytesIO()
    torch.save({"params": {name: p.detach() for name, p in params.items()}, "optimizer": optimizer.state_dict()},
               buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _resume_late(saved: dict, foreach: bool) -> tuple[dict[str, nn.Parameter], LAMB]:
    params = {name: nn.Parameter(w.clone()) for name, w in saved["params"].items()}
    optimizer = _late_lamb(params, "nvlamb_clipped", foreach)
    optimizer.load_state_dict(saved["optimizer"])
    return params, optimizer


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_state_dict_round_trip_with_late_gradients_continues_exactly(foreach):
    saved = _late_checkpoint(foreach)
    assert [group["step"] for group in saved["optimizer"]["param_groups"]] == [LATE_START + 2] * len(LATE_GROUPS)
    params, optimizer = _resume_late(saved, foreach)
    assert [group["step"] for group in optimizer.param_groups] == [LATE_START + 2] * len(LATE_GROUPS)
    _late_steps(params, optimizer, range(LATE_START + 2, LATE_STEPS))

    straight = {name: nn.Parameter(w) for name, w in _late_initial_weights().items()}
    _late_steps(straight, _late_lamb(straight, "nvlamb_clipped", foreach), range(LATE_STEPS))
    for name, p in params.items():
        assert torch.equal(p, straight[name]), name


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_checkpoint_with_per_parameter_steps_resumes_with_the_largest(foreach):
    """A state_dict of the LAMB that counted steps per parameter has no group `step`; each group takes the
    largest of its tensors' counts, which is exact while some tensor of the group had a gradient every step. That
    LAMB saved the counts as 0-d float tensors; they come back as ints."""
    saved = _late_checkpoint(foreach)
    for group in saved["optimizer"]["param_groups"]:
        del group["step"]
    for entry in saved["optimizer"]["state"].values():
        entry["step"] = torch.tensor(float(entry["step"]))
    params, optimizer = _resume_late(saved, foreach)
    # Groups 0 and 1 had a tensor with a gradient at every step; group 2's only tensor started late.
    assert [group["step"] for group in optimizer.param_groups] == [LATE_START + 2, LATE_START + 2, 2]
    _late_steps(params, optimizer, range(LATE_START + 2, LATE_STEPS))
    straight = {name: nn.Parameter(w) for name, w in _late_initial_weights().items()}
    _late_steps(straight, _late_lamb(straight, "nvlamb_clipped", foreach), range(LATE_STEPS))
    for name, p in params.items():
        if name != "x_late":
            assert torch.equal(p, straight[name]), name
        count = optimizer.state[p]["step"]
        assert type(count) is int and count == (LATE_STEPS - LATE_START if name.endswith("_late") else LATE_STEPS)

    # A group none of whose tensors has state gets no step: it counts from 1, as a new group.
    fresh = _late_lamb({name: nn.Parameter(w) for name, w in _late_initial_weights().items()}, "nvlamb_clipped",
                       foreach)
    fresh_state = fresh.state_dict()
    fresh.load_state_dict(fresh_state)
    assert all("step" not in group for group in fresh.param_groups)


def test_a_gradient_laid_out_otherwise_than_its_weight_steps_as_a_contiguous_one():
    """The fused Adam kernel pairs elements by their place in memory: a channels_last weight with a contiguous
    gradient takes the for-loop path (it would mix elements in the kernel)."""
    g = torch.Generator().manual_seed(5)
    weight, grad = torch.randn(8, 3, 2, 2, generator=g), torch.randn(8, 3, 2, 2, generator=g)
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        p = nn.Parameter(weight.clone().contiguous(memory_format=memory_format))
        optimizer = LAMB([p], lr=0.1, max_grad_norm=None)
        for _ in range(3):
            p.grad = grad.clone()  # contiguous, whatever the weight's layout
            optimizer.step()
        results.append(p.detach().contiguous())
    torch.testing.assert_close(results[1], results[0])
