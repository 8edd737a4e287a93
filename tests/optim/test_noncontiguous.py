"""Optimizers and the fp16 overflow agreement on non-contiguous (channels_last) parameters and gradients.

Swin under `channels_last` gives its patch-embedding conv weight (and so its gradient) strides that `.view(-1)`
cannot flatten. Every self-synchronising optimizer must step such a model on two gloo ranks exactly as it steps
the same model with contiguous tensors.
"""

from __future__ import annotations

import torch
from helpers.distributed_harness import run_on_ranks
from torch import nn

from optim import SLAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam
from optim.comm import Comm
from train.grad_sync import SelfSync

STEPS = 6
OPTIMIZERS = {
    "slamb": (SLAMB, dict(lr=1e-2, min_compress_numel=64, sync_interval=3, compress_ratio=0.25)),
    "onebit_adam": (OneBitAdam, dict(lr=1e-2, weight_decay=0.01, freeze_step=3)),
    "onebit_lamb": (OneBitLAMB, dict(lr=1e-2, weight_decay=0.01, freeze_step=3)),
    "zero_one_adam": (ZeroOneAdam, dict(lr=1e-2, weight_decay=0.01, var_freeze_step=3, var_update_scaler=2,
                                        local_step_scaler=2, local_step_clipper=2)),
}


def _model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), nn.Flatten(), nn.Linear(16 * 4, 8))
    if channels_last:
        model[0].to(memory_format=torch.channels_last)
        assert not model[0].weight.is_contiguous()
    return model


def _gradients(model: nn.Module, rank: int, step: int, channels_last: bool) -> None:
    """The same gradient values in either layout (a backward pass would round differently per layout)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    if channels_last:
        model[0].weight.grad = model[0].weight.grad.contiguous(memory_format=torch.channels_last)


def _step_on_rank(rank: int, world_size: int, name: str, channels_last: bool) -> list[torch.Tensor]:
    cls, kwargs = OPTIMIZERS[name]
    model = _model(channels_last)
    optimizer = cls(model.parameters(), comm=Comm(), **kwargs)
    for step in range(STEPS):
        _gradients(model, rank, step, channels_last)
        assert model[0].weight.grad.is_contiguous() != channels_last
        optimizer.step()
    return [p.detach().contiguous() for p in model.parameters()]


def _run(rank: int, world_size: int) -> dict[str, list[list[torch.Tensor]]]:
    return {name: [_step_on_rank(rank, world_size, name, cl) for cl in (False, True)] for name in OPTIMIZERS}


def test_channels_last_parameters_step_like_contiguous_ones_on_two_ranks():
    for rank_result in run_on_ranks(_run, 2):
        for name, (contiguous, channels_last) in rank_result.items():
            for a, b in zip(contiguous, channels_last, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def _overflow_on_rank(rank: int, world_size: int, channels_last: bool) -> list[torch.Tensor]:
    model = _model(channels_last)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    if rank == 1:  # only this rank overflowed: both must see it
        grads[-1][0] = float("inf")
    SelfSync(Comm(), torch.device("cpu")).agree_on_overflow(grads)
    return [torch.isfinite(g).all() for g in grads]


def _overflow(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    return [_overflow_on_rank(rank, world_size, cl) for cl in (False, True)]


def test_overflow_agreement_reaches_a_channels_last_gradient_on_both_ranks():
    """The agreed inf goes into the first gradient, the conv weight's: channels_last there, on every rank."""
    for contiguous, channels_last in run_on_ranks(_overflow, 2):
        assert not contiguous[0] and not channels_last[0]
        assert [bool(f) for f in channels_last] == [bool(f) for f in contiguous]
