"""Optimizers with `compiled=True` (their math compiled by inductor, `optim._compiled`) against their aten ops:
the same steps within 1e-5 relative, checkpoints that load across the two modes, no compiling after the first
steps."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from helpers.compiled_parity import assert_continues, assert_weights_close
from helpers.distributed_harness import run_on_ranks
from helpers.fused_modes import (
    LAMB_CONFIGS,
    ONEBIT,
    ONEBIT_STEPS,
    assert_lamb_matches_eager,
    assert_onebit_lamb_applies_a_groups_momentum_mask,
    assert_onebit_ranks_as_eager,
    assert_onebit_resumes_in_either_mode,
    lamb,
    onebit,
    onebit_ranks_in_both_modes,
)
from helpers.mlp import mlp_steps, small_mlp
from helpers.round_trip import resumed_alongside
from torch import nn
from torch._dynamo.utils import counters

from core.options import InvalidOption
from optim import LAMB, SLAMB, OneBitAdam, param_groups_weight_decay
from optim._compiled import TENSORS_PER_GRAPH, CompiledMath, graph_chunks
from optim._math import FOREACH_CHUNK_NUMEL
from optim.comm import Comm
from optim.compressed import _SERVER_COMPRESS, _decode_into, compress_, unpack_signs
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


def _recorded_graphs(monkeypatch: pytest.MonkeyPatch) -> list[torch.fx.GraphModule]:
    """The graphs every `CompiledMath` traces from now on, run as traced (no inductor): the list fills as they
    compile."""
    graphs, compile_ = [], torch.compile

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **options: compile_(fn, backend=record, fullgraph=True))
    modules = [module for name, module in list(sys.modules.items()) if name.split(".")[0] == "optim"]
    for module in modules:  # every compiled function of the optimizers, however many modules hold one
        for math_ in vars(module).values():
            if isinstance(math_, CompiledMath):
                monkeypatch.setattr(math_, "_compiled", None)
    return graphs


def _slow_on_a_cpu(graphs: list[torch.fx.GraphModule]) -> list[str]:
    """The ops of `graphs` that inductor's CPU loop runs an element or a lane at a time (torch 2.14.1, AVX2): a power
    whose exponent is a tensor (formed again for every 8 elements), `signbit` (element by element, through a buffer)
    and shifts of uint8 (AVX2 has no 8-bit shifts)."""
    def slow(node: torch.fx.Node) -> bool:
        name, first = str(node.target), node.args[0] if node.args else None
        value = first.meta.get("example_value") if isinstance(first, torch.fx.Node) else None
        dtype = value.dtype if isinstance(value, torch.Tensor) else None
        return (("pow" in name and isinstance(node.args[-1], torch.fx.Node)) or "signbit" in name
                or ("shift" in name and dtype == torch.uint8))

    return [f"{node.target}{node.args}" for gm in graphs for node in gm.graph.nodes
            if node.op in ("call_function", "call_method") and slow(node)]


def test_compiled_passes_avoid_what_inductor_runs_element_by_element_on_a_cpu(monkeypatch):
    """Each of these ops made a compiled step take several times its aten ops' time on the CPU (BERT-base, one
    thread): LAMB's `beta ** t` of a 0-d step count, two double-precision `pow` calls per 8 elements, 6.8x its
    memory bound (1.07x with the corrections formed on the host); the compressed all-reduce's `signbit` and uint8
    shifts, 51-69x the bound for the 1-bit family (2.8-3.3x without them). No compiled pass holds one."""
    graphs = _recorded_graphs(monkeypatch)
    model = small_mlp(8, 16, 4)
    mlp_steps(model, _lamb(model, True, lr=1e-2), range(2))
    for name in ONEBIT:
        model = small_mlp(8, 16, 4)
        mlp_steps(model, _onebit(name, model, True), range(ONEBIT_STEPS))
    model = small_mlp(8, 16, 4)
    mlp_steps(model, SLAMB(param_groups_weight_decay(model, 0.01), compiled=True, comm=MirrorComm(2)), range(2))
    assert len(graphs) >= 8  # LAMB's two passes, the 1-bit family's, SLAMB's
    assert _slow_on_a_cpu(graphs) == []


@pytest.mark.parametrize("body", [lambda m, t: m / (1.0 - 0.9**t), lambda m, t: torch.signbit(m - t),
                                  lambda m, t: (m > t).to(torch.uint8) << 3])
def test_an_op_inductor_runs_element_by_element_is_seen(monkeypatch, body):
    """The check above on what the passes held: `beta ** t` of a 0-d tensor, `signbit`, a shift of uint8."""
    graphs = _recorded_graphs(monkeypatch)
    CompiledMath(body)(torch.ones(16), torch.tensor(3.0))
    assert len(_slow_on_a_cpu(graphs)) == 1


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
def _onebit(name: str, model: nn.Module, compiled: bool, comm: Comm | None = None, **overrides):
    return onebit(name, model, "compiled" if compiled else None, comm, **overrides)


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
    assert_onebit_resumes_in_either_mode(name, "compiled")


def test_compiled_onebit_lamb_applies_a_groups_momentum_mask():
    """DeepSpeed's `exp_avg_mask` of a group multiplies the averaged momentum inside the compiled pass too."""
    assert_onebit_lamb_applies_a_groups_momentum_mask("compiled")


def test_the_compiled_decodings_build_for_a_cpu_without_avx512():
    """Inductor's C++ at 256-bit vectors (the AVX2 code of a CPU without AVX-512) builds the traced decodings, which
    give the sign table's values: with a bool view of the bytes, that C++ called a member torch 2.14.1's AVX2
    vectors lack, and every compiled 1-bit step failed on such a CPU."""
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (2, 64), dtype=torch.uint8, generator=generator)
    scales, zeroed = torch.tensor([0.5, 1.5]), torch.zeros(2 * 64, dtype=torch.uint8)
    zeroed[::5] = 0b10000001
    error = torch.randn(512, generator=generator)
    out, ranks_packed = torch.empty(2, 512), torch.empty(64, dtype=torch.uint8)
    with torch._inductor.config.patch({"cpp.simdlen": 256}):
        _decode_into(out, packed, scales, zeroed, compiled=True)
        scale = _SERVER_COMPRESS(packed, scales, error.clone(), ranks_packed)
    decoded = torch.stack([s * unpack_signs(p) for p, s in zip(packed, scales, strict=True)])
    assert torch.equal(out, decoded.masked_fill(unpack_signs(zeroed).view(2, 512) > 0, 0.0))
    assert torch.allclose(scale, compress_(decoded.sum(0) + error, torch.empty(512)), rtol=1e-6)


def test_compiled_onebit_refuses_a_bucket_per_tensor():
    with pytest.raises(InvalidOption, match="compiled"):
        OneBitAdam([nn.Parameter(torch.ones(8))], bucketing="per_tensor", compiled=True)


@pytest.mark.slow
def test_compiled_onebit_family_on_gloo_ranks_with_their_own_data():
    """Real collectives, distinct gradients: the compiled steps keep the replicas bit-identical wherever the eager
    ones do, and each rank within the tolerance of its eager trajectory."""
    assert_onebit_ranks_as_eager(run_on_ranks(onebit_ranks_in_both_modes, 2, "compiled"), "compiled")
