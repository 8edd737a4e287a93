"""SLAMB with `triton=True` (its local pass and update in Triton kernels, `optim.slamb._triton`) against its eager
step: the same steps within 1e-5 relative on 2 mirrored ranks across dense averages, in both layouts and every
option set of the compiled tests, exact resume, and checkpoints that load across the modes. On a machine without a
GPU the kernels run in Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`)."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.distributed_harness import run_on_ranks
from helpers.mlp import mlp_steps
from helpers.round_trip import resumed_alongside
from torch import nn

from core.options import InvalidOption
from optim import SLAMB, get_optimizer_spec, param_groups_weight_decay
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.slamb import _layout

pytest.importorskip("triton")

STEPS = 6  # dense averages after steps 1 and 4 (sync_interval 3)
OPTIONS = {
    "default": {},
    "slamb_v2_official": dict(mask="bernoulli", wd_in_trust_ratio=False, freshness_dtype="fp32"),
    "naive": dict(mask="cyclic", rescale="product_of_interpolations", bias_correction_form="full",
                  stale_ratio_fallback=1, clamp_1d=False),
    "nvlamb_no_decay_groups": dict(always_adapt=False),
}


def _model() -> nn.Module:
    """Masked weights of 12060 and 6030 elements (rows of 4 and 2 coordinates) beside always-synced 1-D tensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(60, 201), nn.GELU(), nn.Linear(201, 30))


def _slamb(model: nn.Module, triton: bool, comm: Comm | None = None, **kwargs) -> SLAMB:
    options = dict(lr=1e-2, compress_ratio=0.2, min_compress_numel=1000, sync_interval=3, beta3=0.9) | kwargs
    return SLAMB(param_groups_weight_decay(model, 0.01), comm=comm or MirrorComm(2), triton=triton, **options)


@pytest.mark.parametrize("gpu_layout", [False, True])
@pytest.mark.parametrize("config", list(OPTIONS))
def test_triton_slamb_matches_eager(monkeypatch, config, gpu_layout):
    if gpu_layout:  # whole tensors in one chunk, the direction's rows scaled in place (a GPU's layout)
        monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    eager, fused = _model(), _model()
    eager_optimizer, optimizer = _slamb(eager, False, **OPTIONS[config]), _slamb(fused, True, **OPTIONS[config])
    mlp_steps(eager, eager_optimizer, range(STEPS))
    mlp_steps(fused, optimizer, range(STEPS))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True)), \
        "the kernels did not run"
    for got, want in zip(optimizer.freshness(), eager_optimizer.freshness(), strict=True):
        assert torch.equal(got, want)


def test_blocks_cut_across_slots_and_rows(monkeypatch):
    """Blocks of 16 elements: every slot spans several, and a block's rows of the mask take their own coefficients
    (rows of 4 and 2 coordinates)."""
    monkeypatch.setattr("optim._triton.BLOCK", 16)
    eager, fused = _model(), _model()
    mlp_steps(eager, _slamb(eager, False), range(3))
    mlp_steps(fused, _slamb(fused, True), range(3))
    assert_weights_close(eager, fused)


def test_a_slot_without_a_gradient_steps_its_chunk_eagerly():
    model, reference = _model(), _model()
    for m in (model, reference):
        m[2].bias.requires_grad_(False)
    mlp_steps(model, _slamb(model, True), range(3))
    mlp_steps(reference, _slamb(reference, False), range(3))
    assert torch.equal(model[2].bias, reference[2].bias)
    assert_weights_close(reference, model)


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(True, True), (False, True), (True, False)])
def test_a_checkpoint_resumes_in_either_mode(saved_by, loaded_by):
    model, _, resumed, _ = resumed_alongside(_model, lambda m: _slamb(m, saved_by), range(3), range(3, STEPS),
                                          make_resumed_optimizer=lambda m: _slamb(m, loaded_by))
    assert_continues(model, resumed, exactly=saved_by == loaded_by)


def test_triton_and_compiled_are_exclusive():
    with pytest.raises(InvalidOption, match="choose one"):
        SLAMB(_model().parameters(), triton=True, compiled=True)


def _ranks_with_and_without_kernels(rank: int, world_size: int) -> dict[str, list]:
    """Per mode, this rank's weights after each step on its own data, and whether its spec says the replicas
    agree then."""
    comm, out = Comm(), {}
    for triton in (True, False):
        model = _model()
        optimizer = _slamb(model, triton, comm)
        weights, agree = [], []
        for step in range(1, STEPS + 1):
            mlp_steps(model, optimizer, range(100 * rank + step, 100 * rank + step + 1))
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            agree.append(get_optimizer_spec("slamb").replicas_agree_after(optimizer, step))
        out[str(triton)] = [weights, agree]
    return out


@pytest.mark.slow
def test_triton_slamb_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the kernels keep the replicas bit-identical wherever the eager steps do
    (after each dense average), and each rank within the tolerance of its eager trajectory."""
    results = run_on_ranks(_ranks_with_and_without_kernels, 2)
    for step in range(STEPS):
        fused, eager = results[0]["True"], results[0]["False"]
        if eager[1][step]:
            assert fused[1][step]
            assert torch.equal(results[0]["True"][0][step], results[1]["True"][0][step]), \
                f"replicas differ after step {step + 1}"
        for r in results:
            a, b = r["False"][0][step], r["True"][0][step]
            assert float((a - b).abs().max() / a.abs().max()) <= RTOL, f"step {step + 1}"
        assert not torch.equal(results[0]["True"][0][step], results[1]["True"][0][step]) or eager[1][step]


@pytest.mark.gpu
def test_compiled_kernels_match_eager_on_a_gpu():
    """The JIT-compiled kernels on CUDA, in the GPU's layout: within the tolerance of the eager steps."""
    eager, fused = _model().cuda(), _model().cuda()
    eager_optimizer, optimizer = _slamb(eager, False), _slamb(fused, True)
    for model, opt in ((eager, eager_optimizer), (fused, optimizer)):
        for seed in range(STEPS):
            g = torch.Generator(device="cuda").manual_seed(seed)
            model(torch.randn(5, 60, generator=g, device="cuda")).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert_weights_close(eager, fused)
