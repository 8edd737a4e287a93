"""The grad-sync policy: what DDP and self-synchronising optimizers each do with wrapping, overflows and state."""

from __future__ import annotations

import functools
import math

import torch
from helpers.distributed_harness import run_on_ranks
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


class _WithConstantBuffer(nn.Module):
    """A layer and a constant buffer, as BERT's position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("position_ids", torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.position_ids)


def _local_mean_grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """What DDP must produce: this rank's gradients of a plain copy, averaged over the ranks by hand."""
    import copy

    import torch.distributed as dist

    plain = copy.deepcopy(model)
    plain(x).square().sum().backward()
    grads = [p.grad for p in plain.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= dist.get_world_size()
    return grads


def _ddp_wrapping(rank: int, world_size: int) -> dict[str, bool]:
    torch.manual_seed(0)
    comm, cpu = Comm(), torch.device("cpu")
    model = _WithConstantBuffer()
    ddp = GradSync(comm, cpu).wrap(model)
    exact, one_storage = True, True
    for step in range(2):  # the second step starts from gradients set to None, as the trainer leaves them
        x = torch.full((2, 4), float(rank + step + 1))
        expected = _local_mean_grads(model, x)
        ddp(x).square().sum().backward()
        exact &= all(torch.allclose(p.grad, e) for p, e in zip(model.parameters(), expected, strict=True))
        one_storage &= len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == 1
        model.zero_grad(set_to_none=True)
    model.position_ids.add_(rank)  # a rank-local value survives a forward: DDP does not broadcast the buffer
    ddp(torch.zeros(1, 4))
    constant_kept = bool(model.position_ids[0] == rank)

    normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    normed_ddp = GradSync(comm, cpu).wrap(normed)
    normed[1].running_mean.fill_(rank)  # running statistics: rank 0's are broadcast before each forward
    normed_ddp(torch.zeros(2, 4))
    return {"exact": exact, "one_storage": one_storage, "constant_kept": constant_kept,
            "statistics_broadcast": bool((normed[1].running_mean == 0).all())}


def test_ddp_keeps_gradients_in_its_buckets_and_broadcasts_only_changing_buffers():
    for rank in run_on_ranks(_ddp_wrapping, 2):
        assert rank == {"exact": True, "one_storage": True, "constant_kept": True, "statistics_broadcast": True}
