"""`adamw`: torch's AdamW in its fused kernel where torch has it, agreeing with torch's default path, with the loss
scaler (not the kernel) deciding overflow skips, and resuming exactly."""

from __future__ import annotations

import pytest
import torch
from helpers.round_trip import resumed_alongside
from torch import nn

from optim import build_optimizer
from optim.adamw import adamw

OPTIONS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _steps(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_fused_where_torch_has_the_kernel_and_unless_a_path_is_chosen():
    assert build_optimizer(_model(), "adamw", {}).param_groups[0]["fused"] is True
    assert adamw([{"params": _model().parameters()}]).param_groups[0]["fused"] is True  # a generator, read twice
    assert adamw(_model().parameters(), foreach=True).param_groups[0]["fused"] is None
    assert adamw(_model().parameters(), fused=False).param_groups[0]["fused"] is False
    with torch.device("meta"):  # torch's fused AdamW refuses meta tensors: the default path there
        assert build_optimizer(_model(), "adamw", {}).param_groups[0]["fused"] is False


def test_fused_agrees_with_torchs_default_path():
    models = {fused: _model() for fused in (True, False)}
    for fused, model in models.items():
        _steps(model, adamw(model.parameters(), fused=fused, **OPTIONS), range(20))
    for p, q in zip(models[True].parameters(), models[False].parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # the kernel rounds apart by a few ulp


def test_the_loss_scaler_skips_an_overflowing_step_itself():
    """Left to the fused kernel, an overflowing step would run (and count as a step) with its update skipped inside."""
    model = _model()
    optimizer = adamw(model.parameters(), **OPTIONS)
    stepped = []
    optimizer.register_step_post_hook(lambda *args: stepped.append(True))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    weights = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(2, 16)).sum() * float("inf")).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert stepped == [] and scaler.get_scale() == 512.0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "default"])
def test_state_dict_round_trip_continues_exactly(fused):
    model, _, resumed, resumed_optimizer = resumed_alongside(
        _model, lambda m: adamw(m.parameters(), fused=fused, **OPTIONS), range(3), range(3, 6), steps=_steps,
        make_resumed_optimizer=lambda m: adamw(m.parameters(), **OPTIONS))  # the checkpoint's `fused` runs
    assert resumed_optimizer.param_groups[0]["fused"] is fused
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
