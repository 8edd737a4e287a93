"""SLAMB with `compiled=True` (its local pass compiled by inductor) against its eager step: the same steps within
1e-5 relative on 2 mirrored ranks across dense averages, no compiling after the first step, checkpoints that load
across the two modes."""

from __future__ import annotations

import pytest
import torch
from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.distributed_harness import run_on_ranks
from helpers.mlp import mlp_steps
from helpers.round_trip import resumed_alongside
from torch import nn
from torch._dynamo.utils import counters

from core.options import InvalidOption
from optim import SLAMB, get_optimizer_spec, param_groups_weight_decay
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.slamb import _layout

STEPS = 6  # dense averages after steps 1 and 4 (sync_interval 3)
OPTIONS = {
    "default": {},
    "slamb_v2_official": dict(mask="bernoulli", wd_in_trust_ratio=False, freshness_dtype="fp32"),
    "naive": dict(mask="cyclic", rescale="product_of_interpolations", bias_correction_form="full",
                  stale_ratio_fallback=1, clamp_1d=False),
    "nvlamb_no_decay_groups": dict(always_adapt=False),
}

pytestmark = pytest.mark.usefixtures("fresh_compiles")  # each test compiles its own graphs


def _model() -> nn.Module:
    """Masked weights of 12060 and 6030 elements (rows of 4 and 2 coordinates) beside always-synced 1-D tensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(60, 201), nn.GELU(), nn.Linear(201, 30))


def _slamb(model: nn.Module, compiled: bool, comm: Comm | None = None, **kwargs) -> SLAMB:
    options = dict(lr=1e-2, compress_ratio=0.2, min_compress_numel=1000, sync_interval=3, beta3=0.9) | kwargs
    return SLAMB(param_groups_weight_decay(model, 0.01), comm=comm or MirrorComm(2), compiled=compiled, **options)



@pytest.mark.parametrize("gpu_layout", [False, True])
@pytest.mark.parametrize("config", list(OPTIONS))
def test_compiled_slamb_matches_eager(monkeypatch, config, gpu_layout):
    if gpu_layout:  # whole tensors in one chunk, the direction's rows scaled in place (a GPU's layout)
        monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    eager, compiled = _model(), _model()
    eager_optimizer, optimizer = _slamb(eager, False, **OPTIONS[config]), _slamb(compiled, True, **OPTIONS[config])
    mlp_steps(eager, eager_optimizer, range(STEPS))
    mlp_steps(compiled, optimizer, range(STEPS))
    assert_weights_close(eager, compiled)
    assert any(not torch.equal(p, q) for p, q in zip(eager.parameters(), compiled.parameters(), strict=True)), \
        "the compiled path did not run"
    for got, want in zip(optimizer.freshness(), eager_optimizer.freshness(), strict=True):
        assert torch.equal(got, want)


def test_compiled_slamb_compiles_in_the_first_step_only():
    model = _model()
    optimizer = _slamb(model, True)
    mlp_steps(model, optimizer, range(1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    mlp_steps(model, optimizer, range(1, STEPS))  # other masks, step counts, a dense average: the same graphs
    optimizer.param_groups[0]["lr"] = 3e-3
    mlp_steps(model, optimizer, range(STEPS, STEPS + 1))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_slot_without_a_gradient_steps_its_chunk_eagerly():
    """The compiled pass takes every slot of a chunk; a chunk with a frozen tensor keeps the eager step, which
    leaves it alone."""
    model = _model()
    frozen = model[2].bias
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    mlp_steps(model, _slamb(model, True), range(2))
    assert torch.equal(frozen, before)


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(False, True), (True, False), (True, True)])
def test_a_checkpoint_resumes_in_either_mode(saved_by, loaded_by):
    model, _, resumed, _ = resumed_alongside(_model, lambda m: _slamb(m, saved_by), range(3), range(3, STEPS),
                                          make_resumed_optimizer=lambda m: _slamb(m, loaded_by))
    assert_continues(model, resumed, exactly=saved_by == loaded_by)


def test_compiled_must_be_a_flag():
    with pytest.raises(InvalidOption, match="compiled"):
        SLAMB([nn.Parameter(torch.ones(2))], compiled="yes")


def _ranks_compiled_and_eager(rank: int, world_size: int) -> dict[str, list]:
    """Per mode, this rank's weights after each step on its own data, and whether its spec says the replicas
    agree then."""
    torch._dynamo.reset()
    comm, out = Comm(), {}
    for compiled in (True, False):
        model = _model()
        optimizer = _slamb(model, compiled, comm)
        weights, agree = [], []
        for step in range(1, STEPS + 1):
            mlp_steps(model, optimizer, range(100 * rank + step, 100 * rank + step + 1))
            weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            agree.append(get_optimizer_spec("slamb").replicas_agree_after(optimizer, step))
        out[str(compiled)] = [weights, agree]
    return out


@pytest.mark.slow
def test_compiled_slamb_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the compiled steps keep the replicas bit-identical wherever the eager
    ones do (after each dense average), and each rank within the tolerance of its eager trajectory."""
    results = run_on_ranks(_ranks_compiled_and_eager, 2)
    for step in range(STEPS):
        compiled, eager = results[0]["True"], results[0]["False"]
        if eager[1][step]:
            assert compiled[1][step]
            assert torch.equal(results[0]["True"][0][step], results[1]["True"][0][step]), \
                f"replicas differ after step {step + 1}"
        for r in results:
            a, b = r["False"][0][step], r["True"][0][step]
            assert float((a - b).abs().max() / a.abs().max()) <= RTOL, f"step {step + 1}"
