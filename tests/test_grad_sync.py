"""The grad-sync policy: what DDP and self-synchronising optimizers each do with wrapping, overflows and state."""

from __future__ import annotations

import functools
import math

import torch
from distributed_harness import run_on_ranks
from torch import nn

from optim.comm import Comm
from train.grad_sync import GradSync, SelfSync, build_grad_sync


def test_policy_is_chosen_by_the_optimizers_sync_kind():
    assert type(build_grad_sync("ddp", Comm(), torch.device("cpu"))) is GradSync
    assert type(build_grad_sync("self", Comm(), torch.device("cpu"))) is SelfSync


def test_checkpoint_split_keeps_per_rank_learner_state_with_each_rank():
    learner = {"model": {"w": 1}, "optimizer": {"m": 2}}
    ddp, own = build_grad_sync("ddp", Comm(), torch.device("cpu")), build_grad_sync("self", Comm(), torch.device("cpu"))
    assert ddp.split_state(learner) == (learner, {})
    assert own.split_state(learner) == ({}, learner)
    assert ddp.learner_state({**learner, "step": 3}, {"rng": 0}) == learner
    assert own.learner_state({"step": 3}, {**learner, "rng": 0}) == learner


def _overflow_on_rank_zero(rank: int, world_size: int) -> tuple[bool, bool, bool]:
    """Rank 0 overflowed; every rank's (channels_last, non-contiguous) gradient must show it afterwards."""
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    conv.weight.grad = torch.ones_like(conv.weight)  # channels_last: `.view(-1)` would raise here
    conv.bias.grad = torch.full_like(conv.bias, math.inf if rank == 0 else 1.0)
    comm = Comm()
    SelfSync(comm, torch.device("cpu")).agree_on_overflow([conv.weight.grad, conv.bias.grad])
    grads = torch.cat([conv.weight.grad.flatten(), conv.bias.grad])
    return (not bool(torch.isfinite(grads).all()), conv.weight.grad.is_contiguous(memory_format=torch.channels_last),
            comm.take_counts()["control_bytes"] == 4)


def _no_overflow(rank: int, world_size: int) -> bool:
    grad = torch.arange(6.0).reshape(2, 3)
    SelfSync(Comm(), torch.device("cpu")).agree_on_overflow([grad])
    return torch.equal(grad, torch.arange(6.0).reshape(2, 3))


def _both_cases(rank: int, world_size: int) -> tuple[tuple[bool, bool, bool], bool]:
    return _overflow_on_rank_zero(rank, world_size), _no_overflow(rank, world_size)


@functools.cache
def _ranks() -> list[tuple[tuple[bool, bool, bool], bool]]:
    """Both cases from one 2-rank spawn (each spawn costs seconds of imports), each with its own Comm."""
    return run_on_ranks(_both_cases, 2)


def test_one_ranks_overflow_reaches_every_rank():
    for overflowed, channels_last, counted in (overflow for overflow, _ in _ranks()):
        assert overflowed and channels_last and counted


def test_no_overflow_leaves_gradients_unchanged():
    assert all(unchanged for _, unchanged in _ranks())
