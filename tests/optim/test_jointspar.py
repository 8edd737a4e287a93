"""JointSpar: layer naming, the sampling design's count and marginals, the projection and the bandit, equality with
the base at full budget, unbiasedness, skipped gradients and cheaper backward, rank agreement and bytes on 2 and 4
gloo ranks, exact resume, option errors. (The trainer's side is in test_jointspar_trainer.py: this module stays
light, since every spawned rank imports it.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.config import optim_preset
from helpers.distributed_harness import run_on_ranks
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import StepTraffic
from core.errors import ConfigError
from optim import LAMB, LARS, JointSpar, check_optimizer_config
from optim._math import mask_seed
from optim.comm import Comm
from optim.jointspar import bandit_update, cost_estimate, layer_name, project_to_budget, systematic_sample
from optim.param_groups import param_groups_weight_decay

WIDTH = 12


def _mlp(depth: int = 6, width: int = WIDTH, seed: int = 0) -> nn.Sequential:
    """`depth` tanh layers and a 3-way head: layers `0`, `2`, ..., `2 depth` (depth + 1 of them)."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = []
    for _ in range(depth):
        modules += [nn.Linear(width, width), nn.Tanh()]
    modules.append(nn.Linear(width, 3))
    return nn.Sequential(*modules)


def _batch(rank: int, step: int, width: int = WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, width, generator=g), torch.randint(0, 3, (16,), generator=g)


def _jointspar(model: nn.Module, comm: Comm | None = None, **options) -> JointSpar:
    options = {"base": "sgd", "base_options": {"momentum": 0.9}, "lr": 0.1, "sample_ratio": 0.4, "p_min": 0.1,
               "eta_p": 0.5, **options}
    return JointSpar(param_groups_weight_decay(model, 0.01, named=True), comm=comm, **options)


def _train_step(model: nn.Module, optimizer: JointSpar, rank: int, step: int) -> None:
    optimizer.zero_grad()
    optimizer.begin_step()
    x, y = _batch(rank, step)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


# ------------------------------------------------------------------------------------------ the pieces
def test_layers_are_numbered_blocks_or_top_level_modules():
    assert layer_name("bert.encoder.layer.3.attention.self.query.weight", "block") == "bert.encoder.layer.3"
    assert layer_name("layers.1.blocks.0.attn.qkv.weight", "block") == "layers.1.blocks.0"
    assert layer_name("layers.1.downsample.reduction.weight", "block") == "layers.1"
    assert layer_name("bert.embeddings.word_embeddings.weight", "block") == "bert.embeddings"
    assert layer_name("cls.predictions.transform.dense.bias", "block") == "cls.predictions"
    assert layer_name("norm.weight", "block") == "norm"
    assert layer_name("4.bias", "block") == "4"
    assert layer_name("bert.encoder.layer.3.output.dense.weight", "tensor") == \
        "bert.encoder.layer.3.output.dense.weight"
    optimizer = _jointspar(_mlp(depth=4))
    assert [layer.name for layer in optimizer.layers] == ["0", "2", "4", "6", "8"]
    assert all(len(layer.params) == 2 for layer in optimizer.layers)  # a weight and its bias, across both groups


def test_systematic_sampling_draws_exactly_k_layers_each_with_its_probability():
    probabilities = torch.tensor([1.0, 0.7, 0.5, 0.3, 0.2, 0.2, 0.1], dtype=torch.float64)  # sums to 3
    draws = 3000
    counts = torch.zeros(7, dtype=torch.float64)
    for t in range(draws):
        sampled = systematic_sample(probabilities, torch.Generator().manual_seed(mask_seed(0, t)))
        assert int(sampled.sum()) == 3
        counts += sampled
    frequency = counts / draws
    sigma = (probabilities * (1 - probabilities) / draws).sqrt()
    assert frequency[0] == 1.0
    assert ((frequency - probabilities).abs() <= 5 * sigma + 1e-12).all(), frequency


def _reference_projection(w: torch.Tensor, budget: float, p_min: float) -> torch.Tensor:
    """Bisection on the scale of `clip(c w, p_min, 1)`, the KL projection's form (KKT)."""
    lo, hi = 0.0, float(1.0 / w.min())
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float((mid * w).clamp(p_min, 1.0).sum()) < budget else (lo, mid)
    return (hi * w).clamp(p_min, 1.0)


@pytest.mark.parametrize("seed", range(5))
def test_projection_meets_the_budget_and_bounds_and_matches_bisection(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(10, generator=g, dtype=torch.float64).pow(3) * 10 + 1e-3  # spread: some clip at 1, some at p_min
    p = project_to_budget(w, 4.0, 0.1)
    assert float(p.sum()) == pytest.approx(4.0, abs=1e-12)
    assert float(p.min()) >= 0.1 - 1e-15 and float(p.max()) <= 1.0
    torch.testing.assert_close(p, _reference_projection(w, 4.0, 0.1), rtol=1e-9, atol=1e-12)
    assert torch.equal(project_to_budget(w, 10.0, 0.1), torch.ones(10, dtype=torch.float64))
    torch.testing.assert_close(project_to_budget(w, 1.0, 0.1), torch.full((10,), 0.1, dtype=torch.float64))


def test_bandit_leaves_uniform_probabilities_alone_at_eta_zero_and_learns_norm_proportional_ones():
    uniform = torch.full((6,), 0.5, dtype=torch.float64)
    norms = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5, 0.25], dtype=torch.float64)
    sampled = torch.tensor([True, False, True, False, True, False])
    assert torch.equal(bandit_update(uniform, sampled, norms, 8.0, 3, 0.05, 0.0), uniform)
    p, scale = uniform, 0.0
    for t in range(2000):
        sampled = systematic_sample(p, torch.Generator().manual_seed(mask_seed(1, t)))
        scale = max(scale, cost_estimate(p, sampled, norms))
        p = bandit_update(p, sampled, torch.where(sampled, norms, 0.0), scale, 3, 0.05, 0.03)
        assert float(p.sum()) == pytest.approx(3.0, abs=1e-9) and float(p.min()) >= 0.05 - 1e-12
    # The variance-optimal p (proportional to the norms, capped at 1, floored); uniform p costs 1.8x its cost.
    optimal = project_to_budget(norms, 3, 0.05)
    assert float((norms.square() / p).sum()) < 1.02 * float((norms.square() / optimal).sum())
    assert p.tolist() == sorted(p.tolist(), reverse=True)


# ------------------------------------------------------------------------------------------ the optimizer
@pytest.mark.parametrize(("base", "base_options", "reference"), [
    ("sgd", {"momentum": 0.9, "nesterov": True}, lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9,
                                                                                 nesterov=True)),
    # A tensor's first momentum buffer is its direction, undamped, as SGD makes it.
    ("sgd", {"momentum": 0.9, "dampening": 0.5}, lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9,
                                                                                 dampening=0.5)),
    ("lars", {"trust_coefficient": 0.02}, lambda groups: LARS(groups, lr=0.1, trust_coefficient=0.02)),
    ("lamb", {"max_grad_norm": 1.0}, lambda groups: LAMB(groups, lr=0.1, max_grad_norm=1.0)),
])
def test_with_every_layer_sampled_it_is_the_base_optimizer(base, base_options, reference):
    model, twin = _mlp(), _mlp()
    optimizer = _jointspar(model, base=base, base_options=base_options, sample_ratio=1.0)
    expected = reference(param_groups_weight_decay(twin, 0.01))
    for step in range(5):
        _train_step(model, optimizer, 0, step)
        expected.zero_grad()
        x, y = _batch(0, step)
        F.cross_entropy(twin(x), y).backward()
        expected.step()
        assert optimizer.probabilities.tolist() == [1.0] * 7
    for ours, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("base", ["sgd", "lars"])
def test_the_update_is_unbiased(base):
    """From one state with fixed gradients and unequal probabilities, the mean update over many draws is the
    base's full update: SGD rescales the gradient by 1/p, LARS its step (its trust ratio cancels a gradient factor)."""
    model = _mlp(depth=3)
    options = {"momentum": 0.0} if base == "sgd" else {"momentum": 0.0, "trust_coefficient": 0.05}
    optimizer = _jointspar(model, base=base, base_options=options, eta_p=0.0, sample_ratio=0.5)
    probabilities = [0.9, 0.6, 0.3, 0.2]
    optimizer.state["jointspar"]["probabilities"] = probabilities
    start = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    full = _mlp(depth=3)
    full.load_state_dict(model.state_dict())
    base_optimizer = optimizer.base.__class__(param_groups_weight_decay(full, 0.01), lr=0.1, **options)
    for p, g in zip(full.parameters(), grads, strict=True):
        p.grad = g.clone()
    base_optimizer.step()
    full_update = [s - p.detach() for s, p in zip(start, full.parameters(), strict=True)]

    trials = 2000
    total = [torch.zeros_like(s) for s in start]
    for _ in range(trials):
        optimizer.zero_grad()
        optimizer.begin_step()
        for p, g in zip(model.parameters(), grads, strict=True):
            if p.requires_grad:
                p.grad = g.clone()  # what backward computes for the sampled layers
        optimizer.step()
        with torch.no_grad():
            for t, s, p in zip(total, start, model.parameters(), strict=True):
                t += s - p
                p.copy_(s)
    assert optimizer.probabilities.tolist() == probabilities  # eta_p = 0
    for index, (mean_total, expected) in enumerate(zip(total, full_update, strict=True)):
        p = probabilities[index // 2]  # weight and bias of a layer
        tolerance = 5 * math.sqrt((1 - p) / (p * trials)) * float(expected.norm())
        assert float((mean_total / trials - expected).norm()) <= tolerance


def test_lars_base_rescales_its_direction_before_the_momentum():
    """LARS's per-layer LR sits inside its momentum buffer in the paper's Algorithm 1: the buffer takes d / p."""
    model, twin = _mlp(), _mlp()
    options = {"momentum": 0.9, "trust_coefficient": 0.05}
    optimizer = _jointspar(model, base="lars", base_options=options, eta_p=0.0)
    reference = LARS(param_groups_weight_decay(twin, 0.01), lr=0.1, **options)
    optimizer.zero_grad()
    optimizer.begin_step()
    x, y = _batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(twin(x), y).backward()
    sampled = optimizer.sampled_layers()
    optimizer.step()
    reference.step()
    p = optimizer.budget / len(optimizer.layers)
    twin_of = {id(q): t for q, t in zip(model.parameters(), twin.parameters(), strict=True)}
    for layer, on in zip(optimizer.layers, sampled, strict=True):
        for param in layer.params:
            twin_param = twin_of[id(param)]
            if on:
                torch.testing.assert_close(optimizer.base.state[param]["momentum_buffer"],
                                           reference.state[twin_param]["momentum_buffer"] / p)
            else:
                assert param not in optimizer.base.state


@pytest.mark.parametrize("unsampled", ["freeze", "decay"])
def test_unsampled_layers_compute_no_gradient_and_keep_their_weights(unsampled):
    model = _mlp()
    optimizer = _jointspar(model, unsampled=unsampled)
    for step in range(3):  # momentum buffers exist once every layer was sampled at least once
        optimizer.zero_grad()
        optimizer.begin_step()
        x, y = _batch(0, step)
        F.cross_entropy(model(x), y).backward()
        sampled = optimizer.sampled_layers()
        before = {id(p): p.detach().clone() for p in model.parameters()}
        buffers = {id(p): optimizer.base.state[p]["momentum_buffer"].clone()
                   for p in model.parameters() if "momentum_buffer" in optimizer.base.state.get(p, {})}
        for layer, on in zip(optimizer.layers, sampled, strict=True):
            assert all((p.grad is not None) == on for p in layer.params)
        optimizer.step()
        assert all(p.requires_grad for p in model.parameters())  # every layer trainable between steps
        for layer, on in zip(optimizer.layers, sampled, strict=True):
            for p in layer.params:
                assert torch.equal(p, before[id(p)]) != on
                if not on and id(p) in buffers:
                    decayed = buffers[id(p)] * 0.9 if unsampled == "decay" else buffers[id(p)]
                    torch.testing.assert_close(optimizer.base.state[p]["momentum_buffer"], decayed, rtol=0, atol=0)


def test_backward_skips_the_weight_gradients_of_unsampled_layers():
    """FLOPs, not time: backward must cost less when layers are left out (dW skipped, and nothing computed
    below the lowest sampled layer); benchmarks/optim/optimizers.py times it."""
    model = _mlp(depth=8, width=64)
    optimizer = _jointspar(model, sample_ratio=0.25, p_min=0.05)
    x, y = torch.randn(64, 64), torch.randint(0, 3, (64,))

    def backward_flops() -> int:
        loss = F.cross_entropy(model(x), y)
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        return counter.get_total_flops()

    dense = backward_flops()
    sparse = []
    for _ in range(10):
        optimizer.zero_grad()
        optimizer.begin_step()
        sparse.append(backward_flops())
        assert sum(optimizer.sampled_layers()) == 2  # round(0.25 x 9 layers)
        optimizer.step()
    # dW of 2 of 9 layers plus the input gradients above the lowest sampled one: at most ~2/3 of the dense.
    assert max(sparse) < 0.7 * dense


def test_a_skipped_step_draws_the_same_layers_again_with_every_layer_trainable_between():
    """An fp16 overflow skips `step()` on every rank (the trainer agrees on it); the trainer's `zero_grad` then makes
    the model whole again, and the retried step must sample the same layers, since the step count did not move."""
    model = _mlp()
    optimizer = _jointspar(model)
    optimizer.begin_step()
    first = optimizer.sampled_layers()
    assert not all(p.requires_grad for p in model.parameters())
    optimizer.zero_grad()  # the trainer's, after a skipped step
    assert all(p.requires_grad for p in model.parameters())
    optimizer.begin_step()
    assert optimizer.sampled_layers() == first
    x, y = _batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    optimizer.begin_step()
    assert optimizer.state["jointspar"]["step"] == 1


def test_a_step_without_begin_step_or_with_stray_gradients_is_refused():
    model = _mlp()
    optimizer = _jointspar(model)
    x, y = _batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"call begin_step\(\) first"):
        optimizer.step()
    optimizer.begin_step()
    for p in model.parameters():  # gradients computed for every layer, as a misordered zero_grad would leave
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="unsampled layers have gradients"):
        optimizer.step()


@pytest.mark.parametrize(("base", "base_options"), [("lamb", {}), ("lars", {}), ("sgd", {"momentum": 0.9})])
def test_resume_from_a_state_dict_is_exact(base, base_options):
    model = _mlp()
    optimizer = _jointspar(model, base=base, base_options=base_options, lr=0.01)
    reference = copy.deepcopy(model)
    reference_optimizer = _jointspar(reference, base=base, base_options=base_options, lr=0.01)
    for step in range(4):
        _train_step(model, optimizer, 0, step)
        _train_step(reference, reference_optimizer, 0, step)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert saved_optimizer["state"]["jointspar"]["step"] == 4
    resumed = _mlp(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = _jointspar(resumed, base=base, base_options=base_options, lr=0.01)
    resumed_optimizer.load_state_dict(saved_optimizer)
    assert resumed_optimizer.probabilities.tolist() == reference_optimizer.probabilities.tolist() != [0.4] * 7
    for step in range(4, 8):
        _train_step(resumed, resumed_optimizer, 0, step)
        _train_step(reference, reference_optimizer, 0, step)
        assert resumed_optimizer.state["jointspar"] == reference_optimizer.state["jointspar"]
    for a, b in zip(resumed.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("base", "keys"), [("lamb", ("exp_avg", "exp_avg_sq")), ("lars", ("momentum_buffer",))])
def test_the_bases_state_is_views_of_flat_buffers_loaded_in_place(base, keys):
    """Every state tensor is a view of its key's one flat buffer, made at the tensor's first step as the base would
    make it; loading a state_dict (here from copies) writes the saved values into those buffers, no new tensors."""
    model = _mlp()
    optimizer = _jointspar(model, base=base, base_options={}, lr=0.01)
    for step in range(3):
        _train_step(model, optimizer, 0, step)
    state = optimizer.base.state
    for key in keys:
        buffer = optimizer.flat[key]
        assert buffer.numel() == sum(p.numel() for p in model.parameters())
        views = [state[p][key] for p in model.parameters() if key in state.get(p, {})]
        assert views and all(v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for v in views)
    saved = copy.deepcopy(optimizer.state_dict())
    params = [p for group in optimizer.param_groups for p in group["params"]]  # the state_dict's order
    stepped = [p in state for p in params]
    for buffer in optimizer.flat.buffers.values():
        buffer.fill_(7.0)
    addresses = {key: optimizer.flat[key].data_ptr() for key in keys}
    optimizer.load_state_dict(saved)
    assert [p in optimizer.base.state for p in params] == stepped
    for key in keys:
        assert optimizer.flat[key].data_ptr() == addresses[key]
        for index, (p, view) in enumerate(zip(params, optimizer.flat.views(key), strict=True)):
            if stepped[index]:
                assert optimizer.base.state[p][key] is view
                assert torch.equal(view, saved["base"]["state"][index][key])
            else:
                assert not view.any()  # never stepped: zeros, as a fresh buffer


@pytest.mark.parametrize(("base", "base_options"), [("sgd", {"momentum": 0.9}), ("lars", {}), ("lamb", {})])
@pytest.mark.parametrize("unsampled", ["freeze", "decay"])
def test_the_ops_per_step_do_not_grow_with_the_layers(base, base_options, unsampled):
    """The base steps every sampled layer in the same multi-tensor ops, each tensor with its layer's 1/p."""
    def ops(depth: int) -> int:
        model = _mlp(depth=depth)
        optimizer = _jointspar(model, base=base, base_options=base_options, unsampled=unsampled)
        for step in range(3):
            _train_step(model, optimizer, 0, step)
        optimizer.zero_grad()
        optimizer.begin_step()
        x, y = _batch(0, 3)
        F.cross_entropy(model(x), y).backward()
        with StepTraffic() as traffic:
            optimizer.step()
        return traffic.ops

    assert ops(4) == ops(9)


# ------------------------------------------------------------------------------------------ several ranks
def _ranks_record(rank: int, world_size: int) -> list[dict]:
    model = _mlp()
    comm = Comm()
    optimizer = _jointspar(model, comm=comm)
    records = []
    for step in range(6):
        optimizer.zero_grad()
        optimizer.begin_step()
        sampled = optimizer.sampled_layers()
        x, y = _batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        numel = sum(layer.numel for layer, on in zip(optimizer.layers, sampled, strict=True) if on)
        records.append({"sampled": sampled, "probabilities": optimizer.probabilities.tolist(),
                        "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                        "sampled_numel": numel, **comm.take_counts()})
    return records


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_agree_on_layers_probabilities_and_weights_and_send_only_the_sampled_layers(world_size):
    ranks = run_on_ranks(_ranks_record, world_size)
    first = ranks[0]
    assert len({tuple(r["sampled"]) for r in first}) > 1  # the layer set changes from step to step
    assert first[-1]["probabilities"] != first[0]["probabilities"]  # and the bandit moved
    for other in ranks[1:]:
        for mine, theirs in zip(first, other, strict=True):
            assert mine["sampled"] == theirs["sampled"] and mine["probabilities"] == theirs["probabilities"]
            assert torch.equal(mine["weights"], theirs["weights"])
    for record in first:
        assert record["bytes"] == 4 * record["sampled_numel"] and record["collectives"] == 1


# ------------------------------------------------------------------------------------------ config and trainer
@pytest.mark.parametrize(("overrides", "start"), [
    ({"base": "adamw"}, "optim.base=adamw must be one of sgd, lars, lamb"),
    ({"base_options": {"lr": 0.1}}, "optim.base_options.lr=0.1 is JointSpar's own option"),
    ({"base": "sgd", "base_options": {"betas": [0.9, 0.99]}}, "optim.base_options.betas is not an option"),
    ({"sample_ratio": 0.0}, "optim.sample_ratio=0.0 must be in (0, 1]"),
    ({"p_min": 0.6}, "optim.p_min=0.6 must be in (0, sample_ratio=0.5]"),
    ({"eta_p": -1.0}, "optim.eta_p=-1.0 must be >= 0"),
    ({"granularity": "row"}, "optim.granularity=row must be one of block, tensor"),
    ({"unsampled": "zero"}, "optim.unsampled=zero must be one of freeze, decay"),
])
def test_bad_options_fail_at_check_time_naming_the_key(overrides, start):
    options = optim_preset("jointspar")
    with pytest.raises(ConfigError) as info:
        check_optimizer_config("jointspar", {**options, **overrides})
    assert str(info.value).startswith(start)


def test_a_floor_above_the_models_budget_is_refused_when_the_layers_are_known():
    with pytest.raises(ConfigError, match=r"JointSpar: p_min=0.3 x the model's 7 layers exceeds the 2 layers"):
        _jointspar(_mlp(), sample_ratio=0.3, p_min=0.3)  # k = round(0.3 x 7) = 2 < 2.1


