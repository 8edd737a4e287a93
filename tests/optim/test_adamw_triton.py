"""AdamW with `triton=True` (its step in one Triton kernel per chunk, `optim._triton_adamw`) against torch's fused
AdamW: the same steps within 1e-5 relative, per-tensor step counts, blocks cut across tensors of any size, torch's
state (a checkpoint resumes on either path), and the refusals. On a machine without a GPU the kernel runs in
Triton's interpreter (tests/conftest.py sets `TRITON_INTERPRET=1`); the `gpu` test runs it compiled on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.mlp import small_mlp
from helpers.round_trip import resumed_alongside
from torch import nn

from core.errors import ConfigError
from optim import build_optimizer, check_optimizer_config
from optim.adamw import AdamW, adamw

pytest.importorskip("triton")

OPTIONS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _adamw(model: nn.Module, triton: bool, **options) -> AdamW:
    decayed = [p for p in model.parameters() if p.ndim > 1]
    others = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": decayed}, {"params": others, "weight_decay": 0.0}]
    return adamw(groups, triton=triton, **(OPTIONS | options))


def _steps(models: list[nn.Module], optimizers: list[AdamW], steps: range, late: set[int] = frozenset()) -> None:
    """The same random gradients for every model; the parameters at positions `late` get theirs from step 3."""
    g = torch.Generator().manual_seed(7)
    for step in steps:
        grads = [torch.randn(p.shape, generator=g) for p in models[0].parameters()]
        for model, optimizer in zip(models, optimizers, strict=True):
            for i, (p, grad) in enumerate(zip(model.parameters(), grads, strict=True)):
                p.grad = None if i in late and step < 3 else grad.to(p.dtype)
            optimizer.step()


def test_the_kernel_matches_torchs_fused_step():
    """Six steps, two groups (one without decay), a tensor that starts late: its own step count sets its bias
    corrections, as in torch."""
    models = [small_mlp(12, 20, 5) for _ in range(2)]
    optimizers = [_adamw(model, triton) for model, triton in zip(models, (False, True), strict=True)]
    assert optimizers[0].param_groups[0]["fused"] and optimizers[1].triton
    _steps(models, optimizers, range(6), late={1})
    assert_weights_close(models[0], models[1])
    steps = [[optimizer.state[p]["step"] for p in model.parameters()] for model, optimizer in
             zip(models, optimizers, strict=True)]
    assert [float(s) for s in steps[1]] == [float(s) for s in steps[0]] == [6.0, 3.0] + [6.0] * (len(steps[0]) - 2)
    assert all(s.dtype == torch.float32 and s.device == p.device for s, p in
               zip(steps[1], models[1].parameters(), strict=True))
    assert not torch.equal(next(models[1].parameters()), next(small_mlp(12, 20, 5).parameters()))


def test_bf16_weights_and_moments_round_as_torchs():
    """bf16 weights and moments, read into fp32 and rounded once on the way back in both kernels: after a step within
    two bf16 units in the last place at each tensor's scale (an fp32 result near the middle of two bf16 values may
    round either way; the moments, at each step's weights, then follow different weights)."""
    models = [small_mlp(12, 20, 5).to(torch.bfloat16) for _ in range(2)]
    optimizers = [_adamw(model, triton) for model, triton in zip(models, (False, True), strict=True)]
    _steps(models, optimizers, range(1))
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        within = 2 * 2.0**-7
        torch.testing.assert_close(q, p, rtol=within, atol=within * float(p.detach().abs().max()))
        assert optimizers[1].state[q]["exp_avg"].dtype == torch.bfloat16
    assert not torch.equal(next(models[1].parameters()), next(small_mlp(12, 20, 5).to(torch.bfloat16).parameters()))


def test_blocks_cut_across_tensors_of_any_size(monkeypatch):
    """Blocks of 16 elements: tensors of one partial block, of whole blocks, of many, and empty ones."""
    monkeypatch.setattr("optim._triton.BLOCK", 16)
    shapes = [(1000,), (5,), (32,), (3, 7), (0,)]
    params = [[nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(shapes)]
              for _ in range(2)]
    optimizers = [adamw(group, triton=triton, **OPTIONS) for group, triton in zip(params, (False, True), strict=True)]
    for step in range(3):
        for group, optimizer in zip(params, optimizers, strict=True):
            for i, p in enumerate(group):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            optimizer.step()
    for expected, got in zip(*params, strict=True):
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=RTOL)  # weights of size 1
    assert not torch.equal(params[1][0], torch.randn(1000, generator=torch.Generator().manual_seed(0)))


def test_a_checkpoint_resumes_exactly():
    model, _, resumed, _ = resumed_alongside(lambda: small_mlp(8, 16, 4), lambda m: _adamw(m, True), range(3),
                                             range(3, 6))
    assert_continues(model, resumed, exactly=True)


@pytest.mark.parametrize(("before", "after"), [(False, True), (True, False)],
                         ids=["fused_to_kernel", "kernel_to_fused"])
def test_a_checkpoint_resumes_on_the_other_path(before, after):
    """The state is torch's: a checkpoint of either path continues on the other, within the paths' rounding."""
    model, _, resumed, optimizer = resumed_alongside(
        lambda: small_mlp(8, 16, 4), lambda m: _adamw(m, before), range(3), range(3, 6),
        make_resumed_optimizer=lambda m: _adamw(m, after))
    assert optimizer.triton is after
    assert_continues(model, resumed, exactly=False)


@pytest.mark.parametrize("option", ["amsgrad", "maximize", "foreach"])
def test_options_the_kernel_does_not_take_are_refused_or_left_to_torch(option):
    """True with such an option: a ValueError before any step, and the config's check names `optim.triton`. Null
    steps in torch's kernel."""
    with pytest.raises(ValueError, match=rf"^AdamW\(triton=True\) does not take {option}=True; set triton=False$"):
        adamw([nn.Parameter(torch.ones(2))], triton=True, **{option: True})
    with pytest.raises(ConfigError, match=rf"optim\.triton=True .*{option}"):
        check_optimizer_config("adamw", {"triton": True, option: True})
    model = small_mlp(4, 8, 2)
    assert build_optimizer(model, "adamw", {"triton": None, option: True}).triton is False


def test_a_tensor_the_kernel_cannot_take_is_an_error_with_true():
    """A transposed weight with a contiguous gradient: their elements do not pair by place in memory. With `true`,
    the step names why; the optimizer left nothing half done."""
    weight = nn.Parameter(torch.ones(3, 4).t())
    optimizer = adamw([weight], triton=True, **OPTIONS)
    weight.grad = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"AdamW\(triton=True\) needs each group's tensors .* dense, with gradients "
                                         r"and moments laid out as their parameters"):
        optimizer.step()
    assert not optimizer.state and torch.equal(weight, torch.ones(4, 3))


def test_a_transposed_weight_with_a_transposed_gradient_steps_in_the_kernel():
    """Dense but not contiguous, gradient and moments laid out alike: the kernel reads each as one block of memory,
    as LAMB's kernels do, and agrees with torch's fused step."""
    weights = [nn.Parameter(torch.randn(5, 7, generator=torch.Generator().manual_seed(3)).t()) for _ in range(2)]
    optimizers = [adamw([w], triton=triton, **OPTIONS) for w, triton in zip(weights, (False, True), strict=True)]
    for step in range(3):
        grad = torch.randn(5, 7, generator=torch.Generator().manual_seed(step)).t()
        for weight, optimizer in zip(weights, optimizers, strict=True):
            weight.grad = grad.clone().t().contiguous().t()  # the transposed layout, as autograd gives a .t() weight
            optimizer.step()
    assert not weights[1].is_contiguous() and optimizers[1].state[weights[1]]["exp_avg"].stride() == (1, 7)
    torch.testing.assert_close(weights[1], weights[0], rtol=RTOL, atol=0)


@pytest.mark.parametrize("unfit", ["counts", "moments"])
def test_loaded_state_the_kernel_cannot_take_is_checked_once_after_the_load(unfit):
    """A loaded state that `_state` did not make: float64 step counts (torch keeps a non-fused run's as saved), or a
    moment laid out apart from its weight. With `true` the next step names it and steps nothing; a fit load steps."""
    weight = nn.Parameter(torch.ones(4, 3))
    optimizer = adamw([weight], triton=True, fused=False, **OPTIONS)
    weight.grad = torch.ones(4, 3)
    optimizer.step()
    saved = optimizer.state_dict()
    state = saved["state"][0]
    if unfit == "counts":
        state["step"] = state["step"].double()
    else:
        state["exp_avg"] = state["exp_avg"].t().contiguous().t()
    before = weight.detach().clone()
    optimizer.load_state_dict(saved)
    message = "step counts on the parameters' device in float32" if unfit == "counts" else "moments laid out"
    with pytest.raises(ValueError, match=rf"AdamW\(triton=True\) needs .*{message}"):
        optimizer.step()
    assert torch.equal(weight, before)
    optimizer.load_state_dict(optimizer.state_dict() | {"state": {0: {
        key: value.float().contiguous() for key, value in optimizer.state_dict()["state"][0].items()}}})
    optimizer.step()
    assert not torch.equal(weight, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_compiled_kernel_matches_torchs_fused_step_on_a_gpu():
    """The JIT-compiled kernel on CUDA, on a model of a few blocks per tensor: within the tolerance of torch's fused
    kernel, and bit for bit the same from the same inputs."""
    models = [small_mlp(300, 64, 40).cuda() for _ in range(3)]
    optimizers = [_adamw(model, triton) for model, triton in zip(models, (False, True, True), strict=True)]
    for _ in range(4):
        g = torch.Generator(device="cuda").manual_seed(0)
        for model, optimizer in zip(models, optimizers, strict=True):
            g.manual_seed(0)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda")
            optimizer.step()
    assert_weights_close(models[0], models[1])
    assert all(torch.equal(p, q) for p, q in zip(models[1].parameters(), models[2].parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_made_by_torchs_step_is_checked_before_the_kernel_reads_it():
    """With null on a GPU, a step the kernel cannot take (a gradient laid out apart from its weight) is torch's, and
    torch's non-fused step keeps its new step counts on the host, where the kernel cannot read them: the next steps
    stay torch's, bit for bit those of torch's AdamW."""
    weights = [nn.Parameter(torch.ones(4, 3, device="cuda")) for _ in range(2)]
    ours = adamw([weights[0]], triton=None, fused=False, **OPTIONS)
    if not ours.triton:
        pytest.skip("the kernel takes an A100, H100 or newer GPU")
    reference = torch.optim.AdamW([weights[1]], fused=False, **OPTIONS)
    for step in range(3):
        grad = torch.full((4, 3), 0.5 + step, device="cuda")
        for weight, optimizer in zip(weights, (ours, reference), strict=True):
            weight.grad = grad.t().contiguous().t() if step == 0 else grad.clone()  # first: strides (1, 4)
            optimizer.step()
    assert ours.state[weights[0]]["step"].device.type == "cpu"
    assert torch.equal(weights[0], weights[1])
