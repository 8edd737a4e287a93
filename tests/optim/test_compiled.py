"""Optimizers with `compiled=True` (their math compiled by inductor, `optim._compiled`) against their aten ops:
the same steps within 1e-5 relative, checkpoints that load across the two modes, no compiling after the first
steps."""

from __future__ import annotations

import io

import pytest
import torch
from helpers.compiled_parity import RTOL, assert_continues, assert_weights_close
from helpers.distributed_harness import run_on_ranks
from helpers.fused_modes import LAMB_CONFIGS, assert_lamb_matches_eager, lamb
from helpers.mlp import mlp_steps, small_mlp
from helpers.round_trip import resumed_alongside
from torch import nn
from torch._dynamo.utils import counters

from core.options import InvalidOption
from optim import LAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam, get_optimizer_spec, param_groups_weight_decay
from optim._compiled import TENSORS_PER_GRAPH, CompiledMath, graph_chunks
from optim._math import FOREACH_CHUNK_NUMEL
from optim.comm import Comm
from optim.mirror_comm import MirrorComm

pytestmark = pytest.mark.usefixtures("fresh_compiles")  # each test compiles its own graphs


def _double_(x: torch.Tensor) -> None:
    x.mul_(2.0)


def test_a_compiled_function_holds_a_graph_per_shape_past_dynamos_default_limit():
    """Dynamo runs a function eagerly, silently, after 8 graphs: BERT-Large's passes need a few dozen."""
    double = CompiledMath(_double_)
    for n in range(1, 13):
        x = torch.ones(n)
        double(x)
        assert torch.equal(x, torch.full((n,), 2.0))
    assert counters["stats"]["unique_graphs"] == 12


def test_graph_chunks_cut_the_device_chunks_into_runs_of_a_few_tensors(monkeypatch):
    monkeypatch.setitem(FOREACH_CHUNK_NUMEL, "cpu", 100)
    tensors = [torch.empty(10)] * 30 + [torch.empty(500)] + [torch.empty(10)] * 5
    chunks = graph_chunks(tensors)
    assert [i for c in chunks for i in range(len(tensors))[c]] == list(range(len(tensors)))
    assert all(0 < c.stop - c.start <= TENSORS_PER_GRAPH for c in chunks)
    assert all(sum(t.numel() for t in tensors[c]) <= 100 or c.stop - c.start == 1 for c in chunks)


def _lamb(model: nn.Module, compiled: bool, **kwargs) -> LAMB:
    return lamb(model, "compiled" if compiled else None, **kwargs)


@pytest.mark.parametrize("config", list(LAMB_CONFIGS))
def test_compiled_lamb_matches_eager(config):
    assert_lamb_matches_eager("compiled", config)


def test_compiled_lamb_compiles_in_the_first_step_only():
    model = small_mlp(8, 16, 4)
    optimizer = _lamb(model, True, lr=1e-2)
    mlp_steps(model, optimizer, range(1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # the two passes over the one chunk of decayed matrices
    mlp_steps(model, optimizer, range(1, 4))  # other learning rates and step counts: the same graphs
    optimizer.param_groups[0]["lr"] = 3e-3
    mlp_steps(model, optimizer, range(4, 5))
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(False, True), (True, False), (True, True)])
def test_a_checkpoint_resumes_in_either_mode(saved_by, loaded_by):
    """A checkpoint's state is the same tensors in both modes: resuming in the same mode continues exactly, in the
    other within the tolerance."""
    model, _, resumed, _ = resumed_alongside(lambda: small_mlp(8, 16, 4), lambda m: _lamb(m, saved_by, lr=1e-2),
                                          range(3), range(3, 6),
                                          make_resumed_optimizer=lambda m: _lamb(m, loaded_by, lr=1e-2))
    assert_continues(model, resumed, exactly=saved_by == loaded_by)


def test_compiled_needs_the_multi_tensor_path():
    with pytest.raises(InvalidOption, match="compiled"):
        LAMB([nn.Parameter(torch.ones(2))], foreach=False, compiled=True)


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


def _onebit(name: str, model: nn.Module, compiled: bool, comm: Comm | None = None, **overrides):
    cls, kwargs = ONEBIT[name]
    optimizer = cls(param_groups_weight_decay(model, 0.01), comm=comm or MirrorComm(2), compiled=compiled,
                    **kwargs | overrides)
    optimizer.deepspeed_roundings = False  # the eager path a GPU takes, which compiled=True also takes
    return optimizer


@pytest.mark.parametrize("name", list(ONEBIT))
def test_compiled_onebit_family_matches_eager(name):
    eager, compiled = small_mlp(8, 16, 4), small_mlp(8, 16, 4)
    mlp_steps(eager, _onebit(name, eager, False), range(ONEBIT_STEPS))
    optimizer = _onebit(name, compiled, True)
    mlp_steps(compiled, optimizer, range(ONEBIT_STEPS - 1))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    mlp_steps(compiled, optimizer, range(ONEBIT_STEPS - 1, ONEBIT_STEPS))
    assert counters["stats"]["unique_graphs"] == graphs  # compiled in the first compressed steps, not after
    assert_weights_close(eager, compiled)


@pytest.mark.parametrize("name", list(ONEBIT))
def test_a_onebit_checkpoint_resumes_in_either_mode(name):
    model = small_mlp(8, 16, 4)
    optimizer = _onebit(name, model, True)
    mlp_steps(model, optimizer, range(ONEBIT_STEPS - 3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    mlp_steps(model, optimizer, range(ONEBIT_STEPS - 3, ONEBIT_STEPS))
    for compiled in (True, False):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        resumed = small_mlp(8, 16, 4)
        resumed.load_state_dict(saved["model"])
        resumed_optimizer = _onebit(name, resumed, compiled)
        resumed_optimizer.load_state_dict(saved["optimizer"])
        mlp_steps(resumed, resumed_optimizer, range(ONEBIT_STEPS - 3, ONEBIT_STEPS))
        assert_continues(model, resumed, exactly=compiled)


def test_compiled_onebit_lamb_applies_a_groups_momentum_mask():
    """DeepSpeed's `exp_avg_mask` of a group multiplies the averaged momentum inside the compiled pass too."""
    models = small_mlp(8, 16, 4), small_mlp(8, 16, 4)
    mask = torch.ones(16, 8)
    mask[::3] = 0.0
    for model, compiled in zip(models, (False, True), strict=True):
        first, *rest = model.parameters()
        optimizer = OneBitLAMB([{"params": [first], "exp_avg_mask": mask}, {"params": rest}], lr=0.01,
                               freeze_step=3, comm=MirrorComm(2), compiled=compiled)
        optimizer.deepspeed_roundings = False
        mlp_steps(model, optimizer, range(ONEBIT_STEPS))
        assert torch.equal(optimizer.state[first]["exp_avg"][::3], torch.zeros(6, 8))
    assert_weights_close(*models)


def test_compiled_onebit_refuses_a_bucket_per_tensor():
    with pytest.raises(InvalidOption, match="compiled"):
        OneBitAdam([nn.Parameter(torch.ones(8))], bucketing="per_tensor", compiled=True)


def _ranks_compiled_and_eager(rank: int, world_size: int) -> dict[str, list]:
    """Per optimizer and mode, this rank's weights after each step on its own data, and whether its spec says the
    replicas agree then."""
    torch._dynamo.reset()
    comm, out = Comm(), {}
    for name in ONEBIT:
        for compiled in (True, False):
            model = small_mlp(8, 16, 4)
            # eps 1e-4: with distinct data, variances frozen this early are tiny, and 0/1 Adam diverges at 1e-8
            optimizer = _onebit(name, model, compiled, comm, eps=1e-4)
            weights, agree = [], []
            for step in range(1, ONEBIT_STEPS + 1):
                mlp_steps(model, optimizer, range(100 * rank + step, 100 * rank + step + 1))
                weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
                agree.append(get_optimizer_spec(name).replicas_agree_after(optimizer, step))
            out[f"{name}/{compiled}"] = [weights, agree]
    return out


@pytest.mark.slow
def test_compiled_onebit_family_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the compiled steps keep the replicas bit-identical wherever the eager
    ones do, and each rank within the tolerance of its eager trajectory."""
    results = run_on_ranks(_ranks_compiled_and_eager, 2)
    for name in ONEBIT:
        for step in range(ONEBIT_STEPS):
            compiled, eager = (results[0][f"{name}/{mode}"] for mode in (True, False))
            if eager[1][step]:
                assert compiled[1][step]
                assert torch.equal(results[0][f"{name}/True"][0][step], results[1][f"{name}/True"][0][step]), \
                    f"{name}: replicas differ after step {step + 1}"
            for r in results:
                a, b = r[f"{name}/False"][0][step], r[f"{name}/True"][0][step]
                assert float((a - b).abs().max() / a.abs().max()) <= RTOL, f"{name}, step {step + 1}"
