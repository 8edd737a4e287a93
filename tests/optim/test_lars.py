"""LARS: against a per-tensor transcription of the update and against timm's Lars, the explicit 1-D exclusion,
the trust-ratio fallbacks, no host reads in the step, exact resume."""

from __future__ import annotations

import pytest
import torch
from helpers.host_reads import count_host_reads
from helpers.round_trip import resumed_alongside
from timm.optim import Lars as TimmLars
from torch import nn

from optim import LARS, param_groups_weight_decay

SHAPES = [(30, 40), (40,), (20, 30), (20,), (5, 5, 2)]  # 1-D: biases / norm parameters
STEPS = 12
VARIANTS = {
    "momentum_decay": dict(momentum=0.9, weight_decay=1e-2),
    "nesterov": dict(momentum=0.9, nesterov=True, weight_decay=5e-4),
    "no_momentum": dict(momentum=0.0, weight_decay=1e-2, trust_coefficient=0.02, eps=1e-3),
    "adapt_1d_too": dict(momentum=0.8, weight_decay=1e-2, exclude_1d=False),
}


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) * 0.1 for shape in SHAPES]


def _grad(step: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(SHAPES[index], generator=g) * 0.01  # plain (1-D) steps of ~1% of the weights


def _lr(step: int) -> float:
    """A changing LR: the schedule's value must act at once (the LR is outside the momentum buffer)."""
    return 2.0 * (1 + step % 3)


def _reference(options: dict) -> list[torch.Tensor]:
    """The update of the `LARS` docstring, transcribed one tensor at a time in float64."""
    momentum, wd = options.get("momentum", 0.9), options["weight_decay"]
    eta, eps = options.get("trust_coefficient", 1e-3), options.get("eps", 1e-8)
    nesterov, exclude_1d = options.get("nesterov", False), options.get("exclude_1d", True)
    params = [t.double() for t in _initial()]
    buffers: list[torch.Tensor | None] = [None] * len(params)
    for step in range(STEPS):
        for i, w in enumerate(params):
            g = _grad(step, i).double()
            if w.dim() > 1 or not exclude_1d:
                w_norm, g_norm = w.norm().item(), g.norm().item()
                ratio = eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
                d = ratio * (g + wd * w)
            else:
                d = g
            if momentum:
                buffers[i] = d.clone() if buffers[i] is None else momentum * buffers[i] + d
                d = d + momentum * buffers[i] if nesterov else buffers[i]
            params[i] = w - _lr(step) * d
    return params


def _ours(options: dict) -> list[torch.Tensor]:
    params = [nn.Parameter(t) for t in _initial()]
    optimizer = LARS(params, **options)  # one group: the 1-D exclusion is by shape, not by group
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grad(step, i)
        optimizer.param_groups[0]["lr"] = _lr(step)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_a_per_tensor_transcription(variant):
    ours, reference = _ours(VARIANTS[variant]), _reference(VARIANTS[variant])
    for i, (got, want) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"tensor {i}: {m}")
        assert not torch.equal(got, _initial()[i])


def _small_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(60, 200), nn.LayerNorm(200), nn.GELU(), nn.Linear(200, 30))


@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_timm_lars_on_a_model_with_weight_decay_groups(nesterov):
    """timm adapts groups with weight decay; here the no-decay group is exactly the 1-D tensors, so they agree."""
    models = [_small_model(), _small_model()]
    options = dict(lr=3.0, momentum=0.9, weight_decay=1e-2, nesterov=nesterov, eps=1e-8)
    ours = LARS(param_groups_weight_decay(models[0], 1e-2), trust_coefficient=1e-3, **options)
    timm = TimmLars(param_groups_weight_decay(models[1], 1e-2), trust_coeff=1e-3, **options)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(8, 60, generator=g)
        for model, optimizer in zip(models, (ours, timm), strict=True):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_1d_tensors_get_plain_steps_whatever_their_group_says():
    weight, bias = nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(4))
    grads = (torch.full((4, 3), 0.5), torch.full((4,), 0.5))
    for exclude_1d in (True, False):
        w, b = nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())
        w.grad, b.grad = grads
        LARS([w, b], lr=1.0, momentum=0.9, weight_decay=0.1, exclude_1d=exclude_1d).step()
        plain_bias = bias - 1.0 * grads[1]  # no trust ratio, no weight decay
        assert torch.equal(b, plain_bias) == exclude_1d
        ratio = 1e-3 * weight.norm() / (grads[0].norm() + 0.1 * weight.norm() + 1e-8)
        torch.testing.assert_close(w, weight - ratio * (grads[0] + 0.1 * weight))
        assert torch.equal(w.grad, grads[0]) and torch.equal(b.grad, grads[1])  # gradients are only read


def test_trust_ratio_is_1_for_a_zero_weight_or_a_zero_gradient():
    zero_weight, zero_grad = nn.Parameter(torch.zeros(3, 3)), nn.Parameter(torch.ones(3, 3))
    zero_weight.grad, zero_grad.grad = torch.ones(3, 3), torch.zeros(3, 3)
    LARS([zero_weight, zero_grad], lr=0.5, momentum=0.0, weight_decay=0.1).step()
    assert torch.equal(zero_weight, torch.full((3, 3), -0.5))  # ratio 1: a plain SGD step
    assert torch.equal(zero_grad, torch.full((3, 3), 1 - 0.5 * 0.1))  # ratio 1 on the decay term alone


def test_step_reads_nothing_on_the_host(monkeypatch):
    reads = count_host_reads(monkeypatch, "optim/lars.py")
    model = _small_model()
    optimizer = LARS(param_groups_weight_decay(model, 1e-2), lr=1.0, nesterov=True)
    for _ in range(2):
        model(torch.ones(2, 60)).sum().backward()
        optimizer.step()
    assert reads == []


def test_state_dict_round_trip_continues_exactly():
    def run(model, optimizer, seeds):
        for seed in seeds:
            model(torch.randn(4, 60, generator=torch.Generator().manual_seed(seed))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    model, _, resumed, _ = resumed_alongside(_small_model, lambda m: LARS(param_groups_weight_decay(m, 1e-2), lr=2.0),
                                          range(3), range(3, 6), steps=run)
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(momentum=1.0), "LARS: momentum=1.0 must be in"),
    (dict(momentum=0.0, nesterov=True), "LARS: nesterov=True needs momentum > 0"),
    (dict(trust_coefficient=0.0), "LARS: trust_coefficient=0.0 must be positive"),
    (dict(lr=-1.0), "LARS: lr=-1.0 must be >= 0"),
])
def test_bad_options_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LARS([nn.Parameter(torch.ones(2))], **kwargs)


def test_a_gradient_laid_out_otherwise_than_its_weight_steps_as_a_contiguous_one():
    """The fused SGD kernel pairs elements by their place in memory: a contiguous gradient of a channels_last weight
    is brought into the weight's layout first."""
    g = torch.Generator().manual_seed(5)
    weight, grad = torch.randn(8, 3, 2, 2, generator=g), torch.randn(8, 3, 2, 2, generator=g)
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        p = nn.Parameter(weight.clone().contiguous(memory_format=memory_format))
        optimizer = LARS([p], lr=1.0, weight_decay=0.01)
        for _ in range(3):
            p.grad = grad.clone()  # contiguous, whatever the weight's layout
            optimizer.step()
        assert p.grad.is_contiguous()  # read, never written
        results.append(p.detach().contiguous())
    torch.testing.assert_close(results[1], results[0])
