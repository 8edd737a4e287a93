"""LAMB with `triton=True` (its trust-ratio tensors in three Triton kernels, `optim._triton_lamb`) against its aten
ops: the same steps within 1e-5 relative, across blocks and tensors of any size, exact resume, and the refusals. On
a machine without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`); the
`gpu` tests run them compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.fused_modes import LAMB_CONFIGS, assert_lamb_matches_eager, lamb
from helpers.mlp import small_mlp
from helpers.round_trip import resumed_alongside
from torch import nn

from core.errors import ConfigError
from core.options import InvalidOption
from optim import LAMB, check_optimizer_config
from optim.lamb import lamb as functional_lamb

pytest.importorskip("triton")

def _lamb(model: nn.Module, triton: bool, **kwargs) -> LAMB:
    return lamb(model, "triton" if triton else None, **kwargs)


@pytest.mark.parametrize("config", list(LAMB_CONFIGS))
def test_triton_lamb_matches_the_aten_ops(config):
    assert_lamb_matches_eager("triton", config)


def _functional_step(tensors: list[list[torch.Tensor]], triton: bool, **options) -> None:
    params, grads, exp_avgs, exp_avg_sqs = tensors
    functional_lamb(params, grads, exp_avgs, exp_avg_sqs, step=3, grad_divisor=None,
         lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, bias_correction=True, trust_clip=False,
         always_adapt=False, foreach=True, triton=triton, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_cut_across_tensors_of_any_size(monkeypatch, dtype):
    """Blocks of 16 elements and block sums added 4 at a time: tensors of one partial block, of whole blocks, and
    of more blocks than one pass of the sums takes (a tensor of 63 blocks is added in 16 passes). bf16 tensors are
    read into fp32 and rounded once on the way back, where the aten ops round the update and its sum with the
    weights each to bf16: within two bf16 units in the last place at each tensor's scale."""
    monkeypatch.setattr("optim._triton.BLOCK", 16)
    monkeypatch.setattr("optim._triton.SUM_BLOCK", 4)
    g = torch.Generator().manual_seed(0)
    shapes = [(1000,), (5,), (32,), (3, 7), (0,)]
    state = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in range(3)]
    state.insert(3, [torch.rand(s, generator=g).to(dtype) for s in shapes])  # v >= 0
    aten, fused = ([[t.clone() for t in tensors] for tensors in state] for _ in range(2))
    _functional_step(aten, triton=False)
    _functional_step(fused, triton=True)
    for kind in (0, 2, 3):  # weights, m, v
        for expected, got in zip(aten[kind], fused[kind], strict=True):
            scale = expected.abs().max().item() if expected.numel() else 0.0
            within = RTOL if dtype == torch.float32 else 2 * 2.0**-7
            torch.testing.assert_close(got, expected, rtol=within, atol=within * scale)
    assert not torch.equal(aten[0][0], state[0][0])


@pytest.mark.parametrize(("layout", "kernels"), [("transposed", True), ("every other row", False)])
def test_the_kernels_take_tensors_that_fill_their_memory(monkeypatch, layout, kernels):
    """A transposed tensor fills one block of memory, as the kernels read it: they step it, as the aten ops do. A view
    of every other row does not: its chunk takes the aten ops."""
    import optim._triton_lamb

    launched, fused_update = [], optim._triton_lamb.triton_lamb_update_

    def recorded(*args, **kwargs) -> None:
        launched.append(args[0])
        fused_update(*args, **kwargs)

    monkeypatch.setattr(optim._triton_lamb, "triton_lamb_update_", recorded)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 10, generator=g) for _ in range(3)]
    full.insert(3, torch.rand(6, 10, generator=g))  # v >= 0

    def laid_out(t: torch.Tensor) -> torch.Tensor:
        return t.t() if layout == "transposed" else t[::2]

    aten, fused = ([[laid_out(t.clone())] for t in full] for _ in range(2))
    assert not fused[0][0].is_contiguous()
    _functional_step(aten, triton=False)
    _functional_step(fused, triton=True)
    assert bool(launched) == kernels
    torch.testing.assert_close(fused[0][0], aten[0][0], rtol=RTOL, atol=RTOL * float(aten[0][0].abs().max()))
    assert not torch.equal(aten[0][0], laid_out(full[0]))


def test_a_checkpoint_resumes_exactly():
    model, _, resumed, _ = resumed_alongside(lambda: small_mlp(8, 16, 4), lambda m: _lamb(m, True, lr=1e-2),
                                          range(3), range(3, 6))
    assert_continues(model, resumed, exactly=True)


def test_a_checkpoint_of_the_aten_ops_resumes_in_the_kernels():
    model, _, resumed, _ = resumed_alongside(lambda: small_mlp(8, 16, 4), lambda m: _lamb(m, False, lr=1e-2),
                                          range(3), range(3, 6),
                                          make_resumed_optimizer=lambda m: _lamb(m, True, lr=1e-2))
    assert_continues(model, resumed, exactly=False)


@pytest.mark.parametrize(("options", "why"), [
    (dict(foreach=False), "multi-tensor path"),
    (dict(compiled=True), "choose one"),
])
def test_conflicting_options_are_refused(options, why):
    with pytest.raises(InvalidOption, match=why):
        LAMB([nn.Parameter(torch.ones(2))], triton=True, **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU refuses the option")
def test_a_machine_without_a_gpu_refuses_the_option_before_any_step(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=r"optim\.triton=True needs a CUDA GPU"):
        check_optimizer_config("lamb", {"triton": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", list(LAMB_CONFIGS))
def test_compiled_kernels_match_the_aten_ops_on_a_gpu(config):
    """The JIT-compiled kernels on CUDA, on a model of a few blocks per tensor: within the tolerance of the aten
    ops, and bit for bit the same from the same inputs (block sums added in a fixed order: no atomics)."""
    models = [small_mlp(300, 64, 40).cuda() for _ in range(3)]
    for model, triton in zip(models, (False, True, True), strict=True):
        optimizer = _lamb(model, triton, **LAMB_CONFIGS[config])
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(4):  # the same gradients for every model (no backward, whose kernels may round otherwise)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda") * 1e-2
            optimizer.step()
    assert_weights_close(models[0], models[1])
    assert all(torch.equal(p, q) for p, q in zip(models[1].parameters(), models[2].parameters(), strict=True))
