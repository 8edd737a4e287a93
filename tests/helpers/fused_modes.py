"""LAMB, SLAMB and the 1-bit family in a fused mode (`compiled`: math compiled by inductor; `triton`: Triton kernels)
held to their eager steps: the models, option sets and runs that both modes' tests share."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.mlp import mlp_steps, small_mlp
from helpers.round_trip import resumed_alongside
from optim import LAMB, SLAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam, get_optimizer_spec, param_groups_weight_decay
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.slamb import _layout

LAMB_CONFIGS = {
    "nvlamb": dict(lr=1e-2, max_grad_norm=0.05),  # pre-normalised by the global gradient norm
    "trust_clip_no_bias_correction": dict(lr=1e-2, max_grad_norm=None, trust_clip=True, bias_correction=False),
    "always_adapt": dict(lr=1e-2, max_grad_norm=None, always_adapt=True),
}
SLAMB_STEPS = 6  # dense averages after steps 1 and 4 (sync_interval 3)
SLAMB_OPTIONS = {
    "default": {},
    "slamb_v2_official": dict(mask="bernoulli", wd_in_trust_ratio=False, freshness_dtype="fp32"),
    "naive": dict(mask="cyclic", rescale="product_of_interpolations", bias_correction_form="full",
                  stale_ratio_fallback=1, clamp_1d=False),
    "nvlamb_no_decay_groups": dict(always_adapt=False),
}


def lamb(model: nn.Module, mode: str | None, **kwargs) -> LAMB:
    """LAMB over `model` (decayed and undecayed groups) in `mode` ("compiled", "triton"; None: the aten ops)."""
    return LAMB(param_groups_weight_decay(model, 0.01), **({mode: True} if mode else {}), **kwargs)


def assert_lamb_matches_eager(mode: str, config: str) -> None:
    """Four steps of the small MLP in `mode` stay within `RTOL` of the aten ops' and differ from them somewhere."""
    eager, fused = small_mlp(8, 16, 4), small_mlp(8, 16, 4)
    mlp_steps(eager, lamb(eager, None, **LAMB_CONFIGS[config]), range(4))
    mlp_steps(fused, lamb(fused, mode, **LAMB_CONFIGS[config]), range(4))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True)), \
        f"the {mode} path did not run"


def slamb_model() -> nn.Module:
    """Masked weights of 12060 and 6030 elements (rows of 4 and 2 coordinates) beside always-synced 1-D tensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(60, 201), nn.GELU(), nn.Linear(201, 30))


def slamb(model: nn.Module, mode: str | None, comm: Comm | None = None, **kwargs) -> SLAMB:
    """SLAMB over `model` in `mode` (None: eager) with 2 mirrored ranks (or `comm`), frequent dense averages."""
    options = dict(lr=1e-2, compress_ratio=0.2, min_compress_numel=1000, sync_interval=3, beta3=0.9) | kwargs
    return SLAMB(param_groups_weight_decay(model, 0.01), comm=comm or MirrorComm(2), **({mode: True} if mode else {}),
                 **options)


def assert_slamb_matches_eager(mode: str, config: str, gpu_layout: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`SLAMB_STEPS` steps in `mode` stay within `RTOL` of the eager steps, with the same freshness; `gpu_layout`:
    whole tensors in one chunk, the direction's rows scaled in place (a GPU's layout), on the CPU."""
    if gpu_layout:
        monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    eager, fused = slamb_model(), slamb_model()
    eager_optimizer = slamb(eager, None, **SLAMB_OPTIONS[config])
    optimizer = slamb(fused, mode, **SLAMB_OPTIONS[config])
    mlp_steps(eager, eager_optimizer, range(SLAMB_STEPS))
    mlp_steps(fused, optimizer, range(SLAMB_STEPS))
    assert_weights_close(eager, fused)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), fused.parameters(), strict=True)), \
        f"the {mode} path did not run"
    for got, want in zip(optimizer.freshness(), eager_optimizer.freshness(), strict=True):
        assert torch.equal(got, want)


def assert_slamb_resumes_across_modes(mode: str, saved_fused: bool, loaded_fused: bool) -> None:
    """A checkpoint written with or without `mode` and loaded with or without it: the same state tensors, so the
    resumed steps go on exactly in the mode it was written in, within `RTOL` in the other."""
    def make(fused: bool):
        return lambda model: slamb(model, mode if fused else None)

    model, _, resumed, _ = resumed_alongside(slamb_model, make(saved_fused), range(3), range(3, SLAMB_STEPS),
                                          make_resumed_optimizer=make(loaded_fused))
    assert_continues(model, resumed, exactly=saved_fused == loaded_fused)


def slamb_ranks_in_both_modes(rank: int, world_size: int, mode: str) -> dict[str, list]:
    """On a gloo rank: per mode (`mode`, then eager), this rank's weights after each step on its own data, and
    whether its spec says the replicas agree then."""
    torch._dynamo.reset()
    comm, out = Comm(), {}
    for fused in (mode, None):
        model = slamb_model()
        optimizer = slamb(model, fused, comm)
        weights, agree = [], []
        for step in range(1, SLAMB_STEPS + 1):
            mlp_steps(model, optimizer, range(100 * rank + step, 100 * rank + step + 1))
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            agree.append(get_optimizer_spec("slamb").replicas_agree_after(optimizer, step))
        out[str(fused)] = [weights, agree]
    return out


def assert_ranks_as_eager(results: list[dict[str, list]], mode: str) -> None:
    """`slamb_ranks_in_both_modes`' results: the fused steps keep the replicas bit-identical wherever the eager ones
    do (after each dense average), and each rank stays within `RTOL` of its eager trajectory."""
    for step in range(SLAMB_STEPS):
        fused, eager = results[0][mode], results[0]["None"]
        if eager[1][step]:
            assert fused[1][step]
            assert torch.equal(results[0][mode][0][step], results[1][mode][0][step]), \
                f"replicas differ after step {step + 1}"
        else:  # each rank stepped on its own data
            assert not torch.equal(results[0][mode][0][step], results[1][mode][0][step])
        for r in results:
            a, b = r["None"][0][step], r[mode][0][step]
            assert float((a - b).abs().max() / a.abs().max()) <= RTOL, f"step {step + 1}"


# ------------------------------------------------------------------------------------------ the 1-bit family
# Past each warm-up by a few compressed steps (0/1 Adam: its 1-bit gradient steps, local steps and syncs), on 2
# mirrored ranks: the compressed all-reduce runs its multi-rank path.
ONEBIT = {
    "onebit_adam": (OneBitAdam, dict(lr=0.01, freeze_step=3)),
    "onebit_lamb": (OneBitLAMB, dict(lr=0.01, freeze_step=3, max_coeff=0.3)),
    "zero_one_adam": (ZeroOneAdam, dict(lr=0.01, var_freeze_step=4, var_update_scaler=1, local_step_scaler=1,
                                        local_step_clipper=2)),
}
ONEBIT_STEPS = 9


def onebit(name: str, model: nn.Module, mode: str | None, comm: Comm | None = None, **overrides):
    """1-bit optimizer `name` over `model` in `mode` (None: the aten ops), on 2 mirrored ranks (or `comm`), with the
    fused roundings (the path a GPU and both fused modes take; a CPU's aten ops take DeepSpeed's otherwise)."""
    cls, kwargs = ONEBIT[name]
    optimizer = cls(param_groups_weight_decay(model, 0.01), comm=comm or MirrorComm(2),
                    **({mode: True} if mode else {}), **kwargs | overrides)
    optimizer.deepspeed_roundings = False
    return optimizer


def assert_onebit_resumes_in_either_mode(name: str, mode: str) -> None:
    """A checkpoint written in `mode` resumes exactly in it, and within `RTOL` with the aten ops."""
    model = small_mlp(8, 16, 4)
    optimizer = onebit(name, model, mode)
    mlp_steps(model, optimizer, range(ONEBIT_STEPS - 3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    mlp_steps(model, optimizer, range(ONEBIT_STEPS - 3, ONEBIT_STEPS))
    for resumed_mode in (mode, None):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        resumed = small_mlp(8, 16, 4)
        resumed.load_state_dict(saved["model"])
        resumed_optimizer = onebit(name, resumed, resumed_mode)
        resumed_optimizer.load_state_dict(saved["optimizer"])
        mlp_steps(resumed, resumed_optimizer, range(ONEBIT_STEPS - 3, ONEBIT_STEPS))
        assert_continues(model, resumed, exactly=resumed_mode == mode)


def onebit_ranks_in_both_modes(rank: int, world_size: int, mode: str) -> dict[str, list]:
    """On a gloo rank: per optimizer and mode (`mode`, then the aten ops), this rank's weights after each step on its
    own data, and whether its spec says the replicas agree then."""
    torch._dynamo.reset()
    comm, out = Comm(), {}
    for name in ONEBIT:
        for fused in (mode, None):
            model = small_mlp(8, 16, 4)
            # eps 1e-4: with distinct data, variances frozen this early are tiny, and 0/1 Adam diverges at 1e-8
            optimizer = onebit(name, model, fused, comm, eps=1e-4)
            weights, agree = [], []
            for step in range(1, ONEBIT_STEPS + 1):
                mlp_steps(model, optimizer, range(100 * rank + step, 100 * rank + step + 1))
                weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
                agree.append(get_optimizer_spec(name).replicas_agree_after(optimizer, step))
            out[f"{name}/{fused}"] = [weights, agree]
    return out


def assert_onebit_ranks_as_eager(results: list[dict[str, list]], mode: str) -> None:
    """`onebit_ranks_in_both_modes`' results: the fused steps keep the replicas bit-identical wherever the aten ops
    do, and each rank stays within `RTOL` of its eager trajectory."""
    for name in ONEBIT:
        fused, eager = (f"{name}/{m}" for m in (mode, None))
        for step in range(ONEBIT_STEPS):
            if results[0][eager][1][step]:
                assert results[0][fused][1][step]
                assert torch.equal(results[0][fused][0][step], results[1][fused][0][step]), \
                    f"{name}: replicas differ after step {step + 1}"
            for r in results:
                a, b = r[eager][0][step], r[fused][0][step]
                assert float((a - b).abs().max() / a.abs().max()) <= RTOL, f"{name}, step {step + 1}"


def assert_onebit_lamb_applies_a_groups_momentum_mask(mode: str) -> None:
    """DeepSpeed's `exp_avg_mask` of a group multiplies the averaged momentum in `mode` as in the aten ops."""
    models = small_mlp(8, 16, 4), small_mlp(8, 16, 4)
    mask = torch.ones(16, 8)
    mask[::3] = 0.0
    for model, fused in zip(models, (None, mode), strict=True):
        first, *rest = model.parameters()
        optimizer = OneBitLAMB([{"params": [first], "exp_avg_mask": mask}, {"params": rest}], lr=0.01,
                               freeze_step=3, comm=MirrorComm(2), **({fused: True} if fused else {}))
        optimizer.deepspeed_roundings = False
        mlp_steps(model, optimizer, range(ONEBIT_STEPS))
        assert torch.equal(optimizer.state[first]["exp_avg"][::3], torch.zeros(6, 8))
    assert_weights_close(*models)
