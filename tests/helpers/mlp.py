"""A small seeded MLP (Linear, LayerNorm, GELU, Linear) and seeded steps on it: the model of optimizer tests that
need weight matrices beside biases and LayerNorm weights, without a transformer."""

from __future__ import annotations

import torch
from torch import nn


def small_mlp(inputs: int, hidden: int, outputs: int) -> nn.Module:
    """The same weights for the same sizes on every call (seed 3), without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(inputs, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, outputs))


def mlp_steps(model: nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    """One optimizer step per seed, on a batch of 5 random inputs drawn from that seed."""
    inputs = model[0].in_features
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        model(torch.randn(5, inputs, generator=g)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
