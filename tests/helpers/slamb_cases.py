"""The multi-rank SLAMB cases that the fast path and the single-tensor reference are both held to: tensor shapes
that mix masked and always-synced ones, the options, and seeded parameters and per-rank gradients."""

from __future__ import annotations

import torch

SHAPES = [(40, 60), (30, 50), (100, 20), (5, 5), (60,)]  # 3 masked tensors; 5x5 (< 100) and 1-D always synced
MIN_NUMEL, K, BETA3, H, N_STEPS = 100, 0.25, 0.9, 4, 12
BETA1, BETA2 = 0.9, 0.999


def initial_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) * 0.1 for shape in SHAPES]


def grad(rank: int, step: int, index: int) -> torch.Tensor:
    """The gradient of tensor `index` on `rank` at `step`: distinct on every rank, step and tensor."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + index)
    return torch.randn(SHAPES[index], generator=g)
