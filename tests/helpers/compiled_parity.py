"""How a compiled optimizer step is held to its eager twin: the tolerance and the weight comparisons."""

from __future__ import annotations

import torch
from torch import nn

RTOL = 1e-5  # inductor orders the norms' sums otherwise than the aten kernels


def assert_weights_close(expected: nn.Module, got: nn.Module) -> None:
    """Every weight within `RTOL`, relative to its tensor's largest magnitude where it is near 0."""
    for p, q in zip(expected.parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=RTOL * p.abs().max().item())


def assert_continues(model: nn.Module, resumed: nn.Module, exactly: bool) -> None:
    """The resumed model went on as the saved one did: bit for bit when `exactly` (resumed in the mode it was saved
    in), else within `RTOL`."""
    if exactly:
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters(), strict=True))
    else:
        assert_weights_close(model, resumed)
