"""The 1-bit family with `triton=True` (the compressed all-reduce in Triton kernels, `optim._triton_compressed`; 1-bit
LAMB's per-tensor factors in `optim._triton_tensorwise`) against the aten ops: the all-reduce's signs and server sum
bit for bit and its values within a few units in the last place, every optimizer's steps within 1e-5 relative, exact
resume, gloo ranks that stay bit-identical. On a machine without a GPU the kernels run in Triton's interpreter
(tests/conftest.py sets `TRITON_INTERPRET=1`); the `gpu` tests run them compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import assert_weights_close
from helpers.distributed_harness import run_on_ranks
from helpers.fused_modes import (
    ONEBIT,
    ONEBIT_STEPS,
    assert_onebit_lamb_applies_a_groups_momentum_mask,
    assert_onebit_ranks_as_eager,
    assert_onebit_resumes_in_either_mode,
    onebit,
    onebit_ranks_in_both_modes,
)
from helpers.mlp import mlp_steps, small_mlp
from torch import nn

from core.options import InvalidOption
from optim import OneBitAdam, OneBitLAMB
from optim.compressed import compressed_allreduce_, padded_numel, zero_codes_
from optim.mirror_comm import MirrorComm

pytest.importorskip("triton")


def _allreduce(world: int, fused: str | None, fed_back: bool, divisor: float | None, zeroed: bool) -> list:
    """One compressed all-reduce of a vector of 3 blocks and a partial one, from non-zero errors: result, errors."""
    numel = padded_numel(7000, world)
    generator = torch.Generator().manual_seed(world)
    x = torch.randn(numel, generator=generator)
    worker, server = torch.randn(numel, generator=generator) * 0.1, torch.randn(numel // world, generator=generator)
    flags = torch.rand(numel, generator=generator) < 0.3
    if fed_back:
        worker.add_(x)
    compressed_allreduce_(x, worker, server, MirrorComm(world), fed_back=fed_back, divisor=divisor,
                          zeroed=zero_codes_(flags) if zeroed else None, fused=fused)
    return [x, worker, server]


@pytest.mark.parametrize(("world", "fed_back", "divisor", "zeroed"),
                         [(2, False, None, False), (3, True, 3.0, True), (4, False, -0.5, True)])
def test_the_compressed_allreduce_in_kernels_is_the_aten_ops(world, fed_back, divisor, zeroed):
    """Signs (hence the result's signs, and which elements are zeroed) bit for bit; the scales, so every value,
    within a few units in the last place (the norm's sum in another order)."""
    eager, fused = (_allreduce(world, mode, fed_back, divisor, zeroed) for mode in (None, "triton"))
    assert torch.equal(torch.signbit(eager[0]), torch.signbit(fused[0]))
    assert torch.equal(eager[0] == 0, fused[0] == 0)
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6 * float(a.abs().max()))


@pytest.mark.parametrize("name", list(ONEBIT))
def test_triton_onebit_family_matches_eager(name):
    eager, fused = small_mlp(8, 16, 4), small_mlp(8, 16, 4)
    mlp_steps(eager, onebit(name, eager, None), range(ONEBIT_STEPS))
    mlp_steps(fused, onebit(name, fused, "triton"), range(ONEBIT_STEPS))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True)), \
        "the triton path did not run"


def test_onebit_lamb_blocks_cut_across_tensors(monkeypatch):
    """Blocks of 16 elements: each tensor of the small MLP spans several (one ends in a partial block), so the
    per-tensor maxima and norms reduce many blocks, the update reads each tensor's coefficient."""
    monkeypatch.setattr("optim._triton.BLOCK", 16)
    eager, fused = small_mlp(8, 17, 4), small_mlp(8, 17, 4)
    mlp_steps(eager, onebit("onebit_lamb", eager, None), range(ONEBIT_STEPS))
    mlp_steps(fused, onebit("onebit_lamb", fused, "triton"), range(ONEBIT_STEPS))
    assert_weights_close(eager, fused)


def test_triton_onebit_lamb_applies_a_groups_momentum_mask():
    """A group with DeepSpeed's `exp_avg_mask` takes the aten update (the mask between the all-reduce and the
    refresh), the compressed all-reduce still in the kernels."""
    assert_onebit_lamb_applies_a_groups_momentum_mask("triton")


@pytest.mark.parametrize("name", list(ONEBIT))
def test_a_triton_onebit_checkpoint_resumes_in_either_mode(name):
    assert_onebit_resumes_in_either_mode(name, "triton")


def test_per_tensor_factors_are_torchs_arithmetic():
    """1-bit LAMB's per-tensor multiply-add and division over tensors that end in partial blocks: torch's foreach
    ops with a 0-d factor per tensor, the division to the last bit, the multiply-add within one rounding (torch's
    CPU kernel fuses it, the interpreter rounds the product first)."""
    from optim._triton_tensorwise import per_tensor_divide, per_tensor_multiply_add

    generator = torch.Generator().manual_seed(0)
    outs = [torch.randn(n, generator=generator) for n in (1, 15, 2049, 4096, 300)]
    ins = [torch.randn_like(t) for t in outs]
    factors = torch.rand(len(outs), dtype=torch.float64, generator=generator) + 0.5
    expected = [t.clone() for t in outs]
    torch._foreach_addcmul_(expected, ins, list(factors.unbind()))
    per_tensor_multiply_add(outs, ins, factors)
    for got, want, x in zip(outs, expected, ins, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-7, atol=2e-7 * float(x.abs().max()))
    outs = [t.clone() for t in expected]
    torch._foreach_div_(expected, list(factors.unbind()))
    per_tensor_divide(outs, factors)
    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))


def test_triton_onebit_refusals():
    with pytest.raises(InvalidOption, match="triton"):
        OneBitAdam([nn.Parameter(torch.ones(8))], triton=True, compiled=True)
    with pytest.raises(ValueError, match="fp32"):
        OneBitLAMB([nn.Parameter(torch.ones(8, dtype=torch.bfloat16))], triton=True)


@pytest.mark.slow
def test_triton_onebit_family_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the kernels keep the replicas bit-identical wherever the aten ops do
    (the norms' sums in a fixed order, no atomic adds), and each rank within 1e-5 of its eager trajectory."""
    assert_onebit_ranks_as_eager(run_on_ranks(onebit_ranks_in_both_modes, 2, "triton"), "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(ONEBIT))
def test_compiled_onebit_kernels_match_the_aten_ops_on_a_gpu(name):
    """The JIT-compiled kernels on CUDA, tensors of several blocks: within the tolerance of the aten ops, and bit for
    bit the same from the same inputs (sums added in a fixed order: no atomics)."""
    models = [small_mlp(300, 64, 40).cuda() for _ in range(3)]
    for model, mode in zip(models, (None, "triton", "triton"), strict=True):
        optimizer = onebit(name, model, mode)
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(ONEBIT_STEPS):  # the same gradients for every model (no backward, which may round otherwise)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda") * 1e-2
            optimizer.step()
    assert_weights_close(models[0], models[1])
    assert all(torch.equal(p, q) for p, q in zip(models[1].parameters(), models[2].parameters(), strict=True))
