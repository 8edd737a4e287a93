"""SLAMB with `triton=True` (its local pass, weights at S_t and update in Triton kernels, `optim.slamb._triton`)
against its eager step: the same steps within 1e-5 relative on 2 mirrored ranks across dense averages, in both
layouts and every option set of the compiled tests, on gloo ranks with their own data, exact resume, and checkpoints
that load across the modes. On a machine without a GPU the kernels run in Triton's interpreter (tests/conftest.py
sets `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import assert_weights_close
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

from core.options import InvalidOption
from optim import SLAMB
from optim.comm import Comm
from optim.mirror_comm import MirrorComm

pytest.importorskip("triton")


def _slamb(model: nn.Module, triton: bool) -> SLAMB:
    return slamb(model, "triton" if triton else None)


@pytest.mark.parametrize("gpu_layout", [False, True])
@pytest.mark.parametrize("config", list(SLAMB_OPTIONS))
def test_triton_slamb_matches_eager(monkeypatch, config, gpu_layout):
    assert_slamb_matches_eager("triton", config, gpu_layout, monkeypatch)


def test_blocks_cut_across_slots_and_rows(monkeypatch):
    """Blocks of 64 elements: every slot spans several and ends in a partial one, and a block's rows of the mask take
    their own coefficients (rows of 4 and 2 coordinates: 16 and 32 rows a block)."""
    monkeypatch.setattr("optim._triton.BLOCK", 64)
    eager, fused = slamb_model(), slamb_model()
    mlp_steps(eager, _slamb(eager, False), range(2))
    mlp_steps(fused, _slamb(fused, True), range(2))
    assert_weights_close(eager, fused)


@pytest.mark.parametrize("wd_in_trust_ratio", [True, False])
def test_decayed_tensors_synced_whole(wd_in_trust_ratio):
    """A decayed weight below `min_compress_numel` is synced whole every step: its direction formed again from the
    averaged momentum in the always-synced slots' kernel, the decay in its norms or not."""
    eager, fused = slamb_model(), slamb_model()
    options = dict(min_compress_numel=7000, wd_in_trust_ratio=wd_in_trust_ratio)  # the 201 x 30 weight: whole
    mlp_steps(eager, slamb(eager, None, **options), range(SLAMB_STEPS))
    mlp_steps(fused, slamb(fused, "triton", **options), range(SLAMB_STEPS))
    assert_weights_close(eager, fused)


def test_unadapted_masked_tensors_gather_m_and_v_alone():
    """No decay and no trust ratio (NVLAMB's plain Adam step) on 2 ranks: the row gather at S_t takes m and v without
    the weights, and the steps stay those of the aten ops."""
    eager, fused = slamb_model(), slamb_model()
    for model, mode in ((eager, {}), (fused, {"triton": True})):
        mlp_steps(model, SLAMB(model.parameters(), lr=1e-2, weight_decay=0.0, always_adapt=False, compress_ratio=0.2,
                               min_compress_numel=1000, sync_interval=3, comm=MirrorComm(2), **mode),
                  range(SLAMB_STEPS))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True))


def test_one_process_takes_the_ratios_from_its_local_sums():
    """One process (nothing averaged): the fresh norms of the trust ratios are the local direction's block sums."""
    eager, fused = slamb_model(), slamb_model()
    mlp_steps(eager, slamb(eager, None, Comm()), range(4))
    mlp_steps(fused, slamb(fused, "triton", Comm()), range(4))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True))


def test_a_slot_without_a_gradient_steps_its_chunk_eagerly():
    model, reference = slamb_model(), slamb_model()
    for m in (model, reference):
        m[2].bias.requires_grad_(False)
    mlp_steps(model, _slamb(model, True), range(3))
    mlp_steps(reference, _slamb(reference, False), range(3))
    assert torch.equal(model[2].bias, reference[2].bias)
    assert_weights_close(reference, model)


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(True, True), (False, True), (True, False)])
def test_a_checkpoint_resumes_in_either_mode(saved_by, loaded_by):
    assert_slamb_resumes_across_modes("triton", saved_by, loaded_by)


def test_triton_and_compiled_are_exclusive():
    with pytest.raises(InvalidOption, match="choose one"):
        SLAMB(slamb_model().parameters(), triton=True, compiled=True)


@pytest.mark.slow
def test_triton_slamb_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the kernels keep the replicas bit-identical wherever the eager steps do
    (after each dense average), and each rank within the tolerance of its eager trajectory."""
    results = run_on_ranks(slamb_ranks_in_both_modes, 2, "triton")
    assert_ranks_as_eager(results, "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernels_match_eager_on_a_gpu():
    """The JIT-compiled kernels on CUDA, in the GPU's layout: within the tolerance of the eager steps."""
    eager, fused = slamb_model().cuda(), slamb_model().cuda()
    for model, opt in ((eager, _slamb(eager, False)), (fused, _slamb(fused, True))):
        for seed in range(SLAMB_STEPS):
            g = torch.Generator(device="cuda").manual_seed(seed)
            model(torch.randn(5, 60, generator=g, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_weights_close(eager, fused)
