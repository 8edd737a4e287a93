"""SLAMB with `compiled=True` (its local pass compiled by inductor) against its eager step: the same steps within
1e-5 relative on 2 mirrored ranks across dense averages, no compiling after the first step, checkpoints that load
across the two modes."""

from __future__ import annotations

import pytest
import torch
from helpers.distributed_harness import run_on_ranks
from helpers.fused_modes import (
    SLAMB_OPTIONS,
    SLAMB_STEPS,
    assert_ranks_as_eager,
    assert_slamb_matches_eager,
    assert_slamb_resumes_across_modes,
    slamb,
    slamb_model,
    slamb_ranks_in_both_modes,
)
from helpers.mlp import mlp_steps
from torch import nn
from torch._dynamo.utils import counters

from core.options import InvalidOption
from optim import SLAMB

pytestmark = pytest.mark.usefixtures("fresh_compiles")  # each test compiles its own graphs


def _slamb(model: nn.Module, compiled: bool) -> SLAMB:
    return slamb(model, "compiled" if compiled else None)


@pytest.mark.parametrize("gpu_layout", [False, True])
@pytest.mark.parametrize("config", list(SLAMB_OPTIONS))
def test_compiled_slamb_matches_eager(monkeypatch, config, gpu_layout):
    assert_slamb_matches_eager("compiled", config, gpu_layout, monkeypatch)


def test_compiled_slamb_compiles_in_the_first_step_only():
    model = slamb_model()
    optimizer = _slamb(model, True)
    mlp_steps(model, optimizer, range(1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    mlp_steps(model, optimizer, range(1, SLAMB_STEPS))  # other masks, step counts, a dense average: the same graphs
    optimizer.param_groups[0]["lr"] = 3e-3
    mlp_steps(model, optimizer, range(SLAMB_STEPS, SLAMB_STEPS + 1))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_slot_without_a_gradient_steps_its_chunk_eagerly():
    """The compiled pass takes every slot of a chunk; a chunk with a frozen tensor keeps the eager step, which
    leaves it alone."""
    model = slamb_model()
    frozen = model[2].bias
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    mlp_steps(model, _slamb(model, True), range(2))
    assert torch.equal(frozen, before)


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(False, True), (True, False), (True, True)])
def test_a_checkpoint_resumes_in_either_mode(saved_by, loaded_by):
    assert_slamb_resumes_across_modes("compiled", saved_by, loaded_by)


def test_compiled_must_be_a_flag():
    with pytest.raises(InvalidOption, match="compiled"):
        SLAMB([nn.Parameter(torch.ones(2))], compiled="yes")


@pytest.mark.slow
def test_compiled_slamb_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the compiled steps keep the replicas bit-identical wherever the eager
    ones do (after each dense average), and each rank within the tolerance of its eager trajectory."""
    results = run_on_ranks(slamb_ranks_in_both_modes, 2, "compiled")
    assert_ranks_as_eager(results, "compiled")
