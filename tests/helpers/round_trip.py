"""An optimizer's checkpoint round trip in memory: the shape of every optimizer's exact-resume test."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from helpers.mlp import mlp_steps

Steps = Callable[[nn.Module, torch.optim.Optimizer, range], None]


class RoundTrip(NamedTuple):
    model: nn.Module  # went on after the checkpoint
    optimizer: torch.optim.Optimizer
    resumed: nn.Module  # loaded the checkpoint, then took the same steps
    resumed_optimizer: torch.optim.Optimizer


def resumed_alongside(make_model: Callable[[], nn.Module],
                      make_optimizer: Callable[[nn.Module], torch.optim.Optimizer], first: range, then: range, *,
                      make_resumed_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
                      steps: Steps = mlp_steps) -> RoundTrip:
    """A model steps `first`, is saved with its optimizer through `torch.save`, and steps `then`; a fresh model and
    optimizer (`make_resumed_optimizer`, default `make_optimizer`) load that checkpoint and step the same `then`.
    Both sides are returned for the caller to compare."""
    model = make_model()
    optimizer = make_optimizer(model)
    steps(model, optimizer, first)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    steps(model, optimizer, then)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_model()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = (make_resumed_optimizer or make_optimizer)(resumed)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    steps(resumed, resumed_optimizer, then)
    return RoundTrip(model, optimizer, resumed, resumed_optimizer)
