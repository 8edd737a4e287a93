"""SLAMB: equals LAMB on one rank with k = 1, and its properties on 1, 2 and 4 ranks."""

from __future__ import annotations

import functools
import math
import os
import signal
from dataclasses import replace

import pytest
import torch
from helpers.config import REPO, TINY, compose
from helpers.dispatched_ops import dispatched_ops, per_tensor_foreach_ops
from helpers.distributed_harness import run_on_ranks
from helpers.host_reads import count_host_reads
from helpers.mlp import mlp_steps, small_mlp
from helpers.round_trip import resumed_alongside
from helpers.runs import popen_train, run_train, wait_for_step
from helpers.slamb_cases import BETA1, BETA2, BETA3, MIN_NUMEL, N_STEPS, SHAPES, H, K, grad, initial_params
from helpers.threads import one_thread
from omegaconf import OmegaConf
from torch import nn

from optim import LAMB, SLAMB, build_optimizer, get_optimizer_spec, param_groups_weight_decay
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.slamb import _layout, _masks
from optim.slamb._masks import mask_uniforms
from train.config import validate
from train.metrics import read_metrics
from train.plan import plan_run

# Spawned ranks import this module to find their worker: helpers.models (transformers) is imported inside the
# tests that use it, so the ranks' start-up imports torch and optim only.

# --------------------------------------------------------------------------------------------- T1
STEPS = 100

# 60x200 and 200x30 weights, masked; biases and LayerNorm always synced
SMALL_MLP = functools.partial(small_mlp, 60, 200, 30)


@functools.cache
def _train_tiny_bert(name: str, mask: str = "", rescale: str = "") -> nn.Module:
    """The tiny pretraining BERT after STEPS steps of LAMB or of SLAMB with one rank and k = 1."""
    from helpers.models import pretraining_batches, tiny_bert_for_pretraining

    model, batches = tiny_bert_for_pretraining(), pretraining_batches()
    groups = param_groups_weight_decay(model, 0.01)
    if name == "lamb":  # the conventions SLAMB uses: trust ratio on every tensor, no pre-normalisation
        optimizer = LAMB(groups, lr=6e-3, always_adapt=True, max_grad_norm=None)
    else:
        # LAMB does not clamp its ratio; SLAMB's c_min = 0.01 would bind on the zero-initialised biases, whose
        # ratio after one step is about lr, so the clamp is opened wide to match LAMB's convention.
        optimizer = SLAMB(groups, lr=6e-3, compress_ratio=1.0, mask=mask, rescale=rescale,
                          bias_correction_form="full", wd_in_trust_ratio=True, trust_ratio_bounds=(1e-6, 1e6))
    with one_thread():
        for step in range(STEPS):
            model(**batches[step % len(batches)]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


@pytest.mark.parametrize("rescale", ["sum_of_products", "product_of_interpolations"])
@pytest.mark.parametrize("mask", ["bernoulli", "cyclic"])
def test_one_rank_with_k_1_equals_lamb(mask, rescale):
    from helpers.models import tiny_bert_for_pretraining

    slamb, lamb = _train_tiny_bert("slamb", mask, rescale), _train_tiny_bert("lamb")
    for (name, p), q in zip(slamb.named_parameters(), lamb.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(lamb.bert.pooler.dense.weight, tiny_bert_for_pretraining().bert.pooler.dense.weight)


# --------------------------------------------------------------------------------------------- one process


def _slamb(model: nn.Module, **kwargs) -> SLAMB:
    options = dict(lr=1e-2, compress_ratio=0.2, min_compress_numel=1000, sync_interval=3) | kwargs
    return SLAMB(param_groups_weight_decay(model, 0.01), **options)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in param_groups order, the order of `sync_masks`."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("mask", ["bernoulli", "cyclic"])
def test_masks_density_small_tensors_and_the_global_rng(mask):
    model = SMALL_MLP()  # 60x200 and 200x30 weights are masked; biases and LayerNorm always synced
    optimizer = _slamb(model, mask=mask, compress_ratio=0.1)
    before = torch.get_rng_state()
    mlp_steps(model, optimizer, range(3))
    assert torch.equal(torch.get_rng_state(), before)  # masks come from a private generator (pitfall P3)
    big = [p.numel() >= 1000 and p.dim() > 1 for p in _params(optimizer)]
    d_big = sum(p.numel() for p, b in zip(_params(optimizer), big, strict=True) if b)
    for step in range(1, 21):
        masks = optimizer.sync_masks(step)
        assert all(m.all() for m, b in zip(masks, big, strict=True) if not b)
        selected = sum(int(m.sum()) for m, b in zip(masks, big, strict=True) if b)
        # |S_t| ~ k d, not (1 - k) d (the inverted mask of the authors' fork, pitfall P11).
        assert abs(selected - 0.1 * d_big) < 6 * math.sqrt(d_big * 0.1 * 0.9) + 2
    again = _slamb(SMALL_MLP(), mask=mask, compress_ratio=0.1)
    assert all(torch.equal(a, b) for a, b in zip(optimizer.sync_masks(7), again.sync_masks(7), strict=True))
    other = _slamb(SMALL_MLP(), mask=mask, compress_ratio=0.1, seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(optimizer.sync_masks(7), other.sync_masks(7), strict=True))


def test_bernoulli_masks_are_independent_acrossmlp_steps():
    optimizer = _slamb(SMALL_MLP(), compress_ratio=0.3)
    masks = torch.stack([optimizer.sync_masks(step)[0].flatten() for step in range(1, 41)]).float()
    per_coordinate = masks.mean(0)  # each coordinate ~ Binomial(40, 0.3) / 40, not a fixed pattern
    assert per_coordinate.mean().item() == pytest.approx(0.3, abs=0.01)
    assert per_coordinate.std().item() == pytest.approx(math.sqrt(0.3 * 0.7 / 40), rel=0.1)
    consecutive = (masks[1:] * masks[:-1]).mean().item()
    assert consecutive == pytest.approx(0.09, abs=0.01)


def test_cyclic_mask_syncs_every_coordinate_once_per_cycle():
    optimizer = _slamb(SMALL_MLP(), mask="cyclic", compress_ratio=0.3)  # floor(1 / 0.3) = 3 chunks
    masks = [optimizer.sync_masks(step)[0] for step in range(1, 7)]
    assert torch.equal(sum(m.int() for m in masks[:3]), torch.ones_like(masks[0], dtype=torch.int))
    assert all(torch.equal(masks[i], masks[i + 3]) for i in range(3))
    assert masks[0].float().mean().item() == pytest.approx(1 / 3, abs=1e-3)


# --------------------------------------------------------------------------------------------- device-independent masks
def test_mask_uniforms_are_the_same_bits_for_any_thread_count_and_split():
    """The host stream a mask is drawn from: serial, so it depends on (seed, step) only."""
    threads = torch.get_num_threads()
    draws = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            draws.append(mask_uniforms(torch.Generator().manual_seed(5), 300_000, torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(5)
    pieces = torch.cat([mask_uniforms(generator, n, torch.device("cpu")) for n in (1, 99_999, 200_000)])
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], pieces)


@pytest.mark.parametrize("mask", ["stratified", "bernoulli"])
def test_masks_drawn_ahead_on_their_threads_are_the_masks_of_their_step(monkeypatch, mask):
    """A GPU's layout draws the next steps' random numbers on threads of their own, several steps at once
    (`MaskSampler.draw_ahead`): the masks asked for are those of their step, and a draw ahead for other steps (a
    loaded state) or another seed changes nothing and is dropped once its step has passed."""
    monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    optimizer = _slamb(SMALL_MLP(), mask=mask)
    optimizer._ensure_layout()
    seed, sampler = optimizer.state["slamb"]["seed"], optimizer._sampler
    drawn_now = [optimizer.sync_masks(step) for step in (3, 4, 5)]
    sampler.draw_ahead(seed, 3, 3)
    sampler.draw_ahead(seed + 1, 4, 1)  # another seed's
    assert set(sampler._ahead) == {(seed, 3), (seed, 4), (seed, 5), (seed + 1, 4)}
    drawn_ahead = [optimizer.sync_masks(3)]
    assert set(sampler._ahead) == {(seed, 4), (seed, 5)}
    sampler.draw_ahead(seed, 9, 2)  # not the steps asked for next: kept until their step has passed
    drawn_ahead += [optimizer.sync_masks(step) for step in (4, 5)]
    assert set(sampler._ahead) == {(seed, 9), (seed, 10)}
    optimizer.sync_masks(11)
    assert not sampler._ahead
    for now, ahead in zip(drawn_now, drawn_ahead, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(now, ahead, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(*drawn_now[:2], strict=True))


@pytest.mark.parametrize("mask", ["stratified", "bernoulli", "cyclic"])
def test_masks_do_not_depend_on_the_chunking(monkeypatch, mask):
    """Chunks are 2^20 elements on a CPU and 2^29 on a GPU: the masks must not change with them."""
    masks = []
    for numel in (_layout.GEOMETRIES["cuda"].chunk_numel, 4000):
        monkeypatch.setitem(_layout.GEOMETRIES, "cpu", replace(_layout.GEOMETRIES["cpu"], chunk_numel=numel))
        optimizer = _slamb(SMALL_MLP(), mask=mask)
        masks.append([optimizer.sync_masks(step) for step in (1, 2)])
    assert len(optimizer._ensure_layout().chunks) > 1
    assert all(torch.equal(a, b) for big, small in zip(*masks, strict=True) for a, b in zip(big, small, strict=True))


@pytest.mark.parametrize("options", [{}, {"mask": "cyclic", "rescale": "product_of_interpolations"},
                                     {"mask": "bernoulli", "wd_in_trust_ratio": False}])
def test_a_gpu_layout_steps_like_the_cpu_layout(monkeypatch, options):
    """A GPU's layout (whole tensors, one chunk, one draw, the direction's rows scaled in place before one foreach
    update) and a CPU's (several chunks and draws, each row's coefficient broadcast over the row) take the same
    steps, to rounding, with masked tensors of mixed row sizes."""
    results = []
    for gpu in (False, True):
        if gpu:
            monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
        else:  # several chunks, draws of a few chunks each
            monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.Geometry(8000, 1000, True, False))
        model = _mixed_rows_model()
        optimizer = _slamb(model, beta3=0.9, comm=MirrorComm(2), **options)  # the multi-rank path
        mlp_steps(model, optimizer, range(6))
        results.append((list(model.parameters()), optimizer.freshness()))
    (cpu_params, cpu_freshness), (gpu_params, gpu_freshness) = results
    assert all(torch.equal(a, b) for a, b in zip(cpu_freshness, gpu_freshness, strict=True))
    for a, b in zip(cpu_params, gpu_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mask", ["stratified", "bernoulli", "cyclic"])
def test_cuda_masks_equal_cpu_masks(mask):
    """Drawn from the host stream, a mask is the same on any device (a CUDA generator's depends on the GPU)."""
    on_cpu = _slamb(SMALL_MLP(), mask=mask)
    on_gpu = _slamb(SMALL_MLP().cuda(), mask=mask)
    for step in (1, 2, 3):
        for a, b in zip(on_cpu.sync_masks(step), on_gpu.sync_masks(step), strict=True):
            assert torch.equal(a, b.cpu())


def _first_step_with_a_skewed_draw(rank: int, world_size: int) -> str:
    """Rank 1 draws its uniforms shifted (as a GPU of another model would have): the first step must refuse."""
    if rank == 1:
        draw = _masks.mask_uniforms
        _masks.mask_uniforms = lambda *args: draw(*args).add_(0.5).remainder_(1.0)
    model = SMALL_MLP()
    optimizer = _slamb(model, comm=Comm())
    try:
        mlp_steps(model, optimizer, range(1))
    except RuntimeError as error:
        return str(error)
    return "stepped"


def test_ranks_that_draw_different_masks_fail_at_their_first_step():
    for rank, message in enumerate(run_on_ranks(_first_step_with_a_skewed_draw, 2)):
        assert "drew different sync masks" in message and f"rank {rank}" in message


# r is q / q_t with q stored in fp16 (q_t: the stored value of a coordinate synced at t, so r = 1 exactly there):
# one rounding (2^-11 relative) when written, one in q_t, one more per rescaling
# every R steps (fp16 subnormals below 2^-14: an absolute error of at most 2^-25, times beta3^(t mod R) <= 1).
FP16_ROUNDING = 2.0**-11


def _mixed_rows_model() -> nn.Module:
    """Masked weights of 12060 and 6030 elements: rows of 4 and 2 coordinates, placed after the 1-D tensors."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(60, 201), nn.GELU(), nn.Linear(201, 30))


@pytest.mark.parametrize(("beta3", "steps", "build"), [(0.93, 15, SMALL_MLP), (0.7, 100, SMALL_MLP),
                                                       (0.93, 15, _mixed_rows_model)])  # 0.7: R = 30
def test_freshness_is_beta3_to_the_staleness(beta3, steps, build):
    model = build()
    optimizer = _slamb(model, beta3=beta3)
    staleness = [torch.zeros_like(p) for p in _params(optimizer)]
    for step in range(1, steps + 1):
        mlp_steps(model, optimizer, range(step, step + 1))
        rescalings = step // optimizer._layout.rebase_interval
        for r, j, mask in zip(optimizer.freshness(), staleness, optimizer.sync_masks(step), strict=True):
            j.add_(1).masked_fill_(mask, 0)
            torch.testing.assert_close(r, beta3**j, rtol=(2 + rescalings) * FP16_ROUNDING, atol=2.0**-24)
            torch.testing.assert_close(r[mask], torch.ones_like(r[mask]), rtol=2.0**-23, atol=0)  # 1 where synced


@pytest.mark.parametrize("written_as", ["fp32 r", "per-coordinate q"])
def test_freshness_from_a_checkpoint_of_an_earlier_version_is_adopted(written_as):
    """A state_dict written when SLAMB stored r in fp32 (key "freshness"), or q per coordinate (before it kept
    one per row of the mask), loads as the same r to fp16 rounding."""
    model = SMALL_MLP()
    optimizer = _slamb(model, beta3=0.93)
    mlp_steps(model, optimizer, range(7))
    freshness = optimizer.freshness()
    assert any(bool((r < 1).any()) for r in freshness)
    saved = optimizer.state_dict()
    synced = optimizer._layout.synced_value(0.93, 7)
    for index, r in enumerate(freshness):  # state_dict numbers the parameters in param_groups order
        del saved["state"][index]["scaled_freshness"]
        if written_as == "fp32 r":
            saved["state"][index]["freshness"] = r.clone()
        else:
            saved["state"][index]["scaled_freshness"] = (r * synced).half()
    resumed = _slamb(model, beta3=0.93)
    resumed.load_state_dict(saved)
    for got, want in zip(resumed.freshness(), freshness, strict=True):
        torch.testing.assert_close(got, want, rtol=3 * FP16_ROUNDING, atol=0)


@pytest.mark.parametrize("mask", ["bernoulli", "cyclic"])
def test_state_dict_round_trip_continues_exactly(mask):
    model, optimizer, resumed, resumed_optimizer = resumed_alongside(
        SMALL_MLP, lambda m: _slamb(m, mask=mask, seed=5), range(5), range(5, 10),
        make_resumed_optimizer=lambda m: _slamb(m, mask=mask, seed=0))  # the seed comes from the checkpoint
    assert resumed_optimizer.state["slamb"] == {"step": 10, "seed": 5}
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "scaled_freshness"):
            assert torch.equal(optimizer.state[p][key], resumed_optimizer.state[q][key])


def test_a_loaded_state_fills_the_flat_buffers_in_place():
    """Loading writes into the buffers that already exist (no second copy of the state), and each parameter's
    state is a view of them again afterwards."""
    model = SMALL_MLP()
    optimizer = _slamb(model, seed=5)
    mlp_steps(model, optimizer, range(3))
    saved = optimizer.state_dict()
    saved = {**saved, "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in entry.items()}
                                for k, entry in saved["state"].items()}}
    resumed = _slamb(model, seed=0)
    layout = resumed._ensure_layout()
    buffers = [layout.exp_avg.data_ptr(), layout.exp_avg_sq.data_ptr(), layout.scaled_freshness.data_ptr()]
    resumed.load_state_dict(saved)
    assert [layout.exp_avg.data_ptr(), layout.exp_avg_sq.data_ptr(), layout.scaled_freshness.data_ptr()] == buffers
    for p in model.parameters():
        for key, buffer in (("exp_avg", layout.exp_avg), ("exp_avg_sq", layout.exp_avg_sq),
                            ("scaled_freshness", layout.scaled_freshness)):
            view = resumed.state[p][key]
            assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            assert torch.equal(view, optimizer.state[p][key])


def test_parameters_without_gradients_are_left_alone():
    model = SMALL_MLP()
    optimizer = _slamb(model)
    frozen_out = model[3].weight.detach().clone()
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        model[1](model[0](torch.randn(5, 60, generator=g))).square().mean().backward()  # model[3] gets no grad
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(model[3].weight, frozen_out)
    assert not optimizer.state[model[3].weight]["exp_avg"].any()
    assert optimizer.state[model[0].weight]["exp_avg"].any()


def test_weight_decay_outside_the_trust_ratio_and_full_bias_correction_differ_from_defaults():
    results = {}
    for name, options in {"default": {}, "v2_decay": dict(wd_in_trust_ratio=False),
                          "full": dict(bias_correction_form="full")}.items():
        model = SMALL_MLP()
        mlp_steps(model, _slamb(model, weight_decay=0.5, **options), range(3))
        results[name] = model[0].weight.detach()
    assert not torch.equal(results["default"], results["v2_decay"])
    assert not torch.equal(results["default"], results["full"])


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(compress_ratio=0.0), "compress_ratio=0.0"),
        (dict(beta3=1.5), "beta3=1.5"),
        (dict(sync_interval=0), "sync_interval=0"),
        (dict(trust_ratio_bounds=(0.0, 10.0)), "trust_ratio_bounds"),
        (dict(mask="topk"), "mask=topk"),
        (dict(rescale="max"), "rescale=max"),
        (dict(bias_correction_form="half"), "bias_correction_form=half"),
        (dict(comm_dtype="int8"), "comm_dtype=int8"),
        (dict(stale_ratio_fallback=0.5), "stale_ratio_fallback=0.5"),
        (dict(sync_offset=2), "sync_offset=2"),
    ],
)
def test_bad_hyper_parameters_name_the_value(kwargs, value):
    with pytest.raises(ValueError, match=value.replace(".", r"\.").replace("(", r"\(")):
        SLAMB([nn.Parameter(torch.ones(2))], **kwargs)


# --------------------------------------------------------------------------------------------- bytes
def test_fp16_momentum_payload_is_half_the_fp32_bytes():
    """comm_dtype fp16 sends 2 bytes per synced coordinate: half of fp32's, on steps without a dense sync."""
    sent = {}
    for dtype in ("fp32", "fp16"):
        params = [nn.Parameter(t.clone()) for t in initial_params()]
        comm = MirrorComm(2)
        optimizer = SLAMB(params, comm=comm, comm_dtype=dtype, compress_ratio=K, min_compress_numel=MIN_NUMEL,
                          sync_interval=H)
        for t in range(1, 4):
            for i, p in enumerate(params):
                p.grad = grad(0, t, i)
            optimizer.step()
            sent[dtype, t] = comm.take_counts()["bytes"], sum(int(m.sum()) for m in optimizer.sync_masks(t))
    d = sum(math.prod(s) for s in SHAPES)
    for t in (2, 3):  # step 1 also averages the parameters densely, in fp32
        assert sent["fp32", t] == (4 * sent["fp32", t][1], sent["fp16", t][1])
        assert sent["fp16", t][0] * 2 == sent["fp32", t][0]
    assert sent["fp16", 1][0] == 2 * sent["fp16", 1][1] + 4 * d


# --------------------------------------------------------------------------------------------- host syncs
_SLAMB_FILES = (str(REPO / "optim" / "slamb") + os.sep, str(REPO / "optim" / "_math.py"))


@pytest.fixture
def host_reads(monkeypatch):
    """Host reads of tensor values (each one a device sync on a GPU) made while SLAMB's code is on the stack."""
    return count_host_reads(monkeypatch, *_SLAMB_FILES, anywhere_on_stack=True)


MULTI_RANK_VARIANTS = [
    dict(),
    dict(mask="bernoulli"),
    dict(mask="cyclic", rescale="product_of_interpolations", clamp_1d=False),
    dict(wd_in_trust_ratio=False, comm_dtype="fp16"),
    dict(always_adapt=False, rescale="product_of_interpolations"),
]


@pytest.mark.parametrize("options", MULTI_RANK_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_multi_rank_step_reads_nothing_on_the_host(host_reads, options):
    """Sizes come from the layout, ratios stay on the device: not one host read in a step, dense syncs included."""
    params = [nn.Parameter(t.clone()) for t in initial_params()]
    optimizer = SLAMB([{"params": params[:4], "weight_decay": 0.01}, {"params": params[4:], "weight_decay": 0.0}],
                      comm=MirrorComm(4), compress_ratio=K, min_compress_numel=MIN_NUMEL, sync_interval=2, **options)
    for step in range(1, 5):
        for i, p in enumerate(params):
            p.grad = grad(0, step, i)
        optimizer.step()
        if step == 1:  # the first step's one read: the ranks' check that they drew the same masks
            assert len(host_reads) == 1 and "_masks.py" in host_reads[0]
            host_reads.clear()
    assert host_reads == []


def test_the_host_read_counter_sees_a_read(host_reads):
    code = compile("torch.ones(()).item()", _SLAMB_FILES[0], "exec")
    exec(code, {"torch": torch})
    assert len(host_reads) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", MULTI_RANK_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_cuda_step_makes_no_device_sync(options):
    """On a GPU the step, on the multi-rank path, runs under sync debug mode "error": any sync raises."""
    params = [nn.Parameter(t.clone().cuda()) for t in initial_params()]
    optimizer = SLAMB([{"params": params[:4], "weight_decay": 0.01}, {"params": params[4:], "weight_decay": 0.0}],
                      comm=MirrorComm(4), compress_ratio=K, min_compress_numel=MIN_NUMEL, sync_interval=2, **options)
    grads = [[grad(0, step, i).cuda() for i in range(len(SHAPES))] for step in range(1, 5)]
    optimizer.step()  # builds the layout (its one-off copies from the host may sync)
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g
            optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(p).all() for p in params)


# --------------------------------------------------------------------------------------------- host cost
STEP_VARIANTS = [dict(), dict(mask="bernoulli"), dict(mask="cyclic"), dict(rescale="product_of_interpolations"),
                 dict(mask="cyclic", rescale="product_of_interpolations", wd_in_trust_ratio=False)]


def _stepped(tensors: int, options: dict) -> SLAMB:
    """SLAMB over `tensors` masked matrices (two row sizes: 16 and 4) and one always-synced vector, on the
    multi-rank path, after its first step (which builds the layout and checks that the ranks agree on the masks);
    gradients are left in place for the next."""
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn((32, 32) if i % 2 else (34, 30), generator=generator)) for i in range(tensors)]
    params.append(nn.Parameter(torch.randn(32, generator=generator)))  # always synced
    optimizer = SLAMB(params, comm=MirrorComm(2), min_compress_numel=500, **options)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("options", STEP_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_step_dispatches_a_number_of_ops_independent_of_the_number_of_tensors(monkeypatch, options):
    """On a GPU each op Python dispatches costs microseconds of host time whatever its size: with a GPU's layout
    (whole tensors, one chunk) four times the masked tensors cost not one op more."""
    monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    few, many = (sum(dispatched_ops(_stepped(n, options).step).values()) for n in (8, 32))
    assert few == many


@pytest.mark.parametrize("options", STEP_VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_gpu_step_launches_one_kernel_per_foreach_list(monkeypatch, options):
    """With a GPU's layout no foreach op broadcasts or takes per-tensor 0-d factors: CUDA would launch a kernel
    per tensor for it (hundreds per op on BERT-Large, host time that a step's median pays whenever the host falls
    behind)."""
    monkeypatch.setitem(_layout.GEOMETRIES, "cpu", _layout.GEOMETRIES["cuda"])
    optimizer = _stepped(8, options)
    assert per_tensor_foreach_ops(optimizer.step) == []


def test_a_step_runs_on_the_meta_device():
    """The step-cost benchmark counts a GPU's step on the meta device: no pinned memory, no host read there."""
    params = [nn.Parameter(torch.empty(64, 48, device="meta")), nn.Parameter(torch.empty(48, device="meta"))]
    optimizer = SLAMB(params, comm=MirrorComm(2), min_compress_numel=500)
    for p in params:
        p.grad = torch.empty_like(p)
    for _ in range(2):
        optimizer.step()
    assert optimizer._layout.geometry == _layout.GEOMETRIES["cuda"]


# --------------------------------------------------------------------------------------------- always_adapt
@pytest.mark.parametrize("rescale", ["sum_of_products", "product_of_interpolations"])
def test_without_always_adapt_no_decay_tensors_take_plain_adammlp_steps(rescale):
    """always_adapt=False (NVLAMB): every tensor of a zero-decay group, masked or not, moves by exactly lr u~, its
    trust ratio 1 and unclamped (c_min = 2 here would raise it); the decayed tensors keep their clamped ratios."""
    params = [nn.Parameter(t.clone()) for t in initial_params()]
    groups = [{"params": params[:2], "weight_decay": 0.01}, {"params": params[2:], "weight_decay": 0.0}]
    lr, eps = 1e-2, 1e-6
    optimizer = SLAMB(groups, lr=lr, eps=eps, betas=(BETA1, BETA2), compress_ratio=K, min_compress_numel=MIN_NUMEL,
                      trust_ratio_bounds=(2.0, 1000.0), rescale=rescale, always_adapt=False)
    m = [torch.zeros(shape) for shape in SHAPES]
    v = [torch.zeros(shape) for shape in SHAPES]
    for t in range(1, 4):
        before = [p.detach().clone() for p in params]
        for i, p in enumerate(params):
            p.grad = grad(0, t, i)
        optimizer.step()
        for i, p in enumerate(params):
            m[i].lerp_(p.grad, 1 - BETA1)
            v[i].mul_(BETA2).addcmul_(p.grad, p.grad, value=1 - BETA2)
            adam = -lr * math.sqrt(1 - BETA2**t) / (1 - BETA1**t) * m[i] / (v[i].sqrt() + eps)
            if i >= 2:
                torch.testing.assert_close(p.detach() - before[i], adam, rtol=1e-5, atol=1e-7)  # w rounding
            else:  # ratio >= c_min = 2: at least twice the plain step, decay included
                assert (p.detach() - before[i]).norm() > 1.5 * (adam - lr * 0.01 * before[i]).norm()


# --------------------------------------------------------------------------------------------- N ranks
def _scenario_options(name: str) -> dict:
    common = dict(lr=1e-2, beta3=BETA3, min_compress_numel=MIN_NUMEL, seed=11)
    return common | {
        "bernoulli": dict(compress_ratio=K, sync_interval=H, bucket_mb=0.002),  # 524 fp32 per bucket
        "cyclic": dict(compress_ratio=K, sync_interval=H, mask="cyclic"),
        "fp16": dict(compress_ratio=K, sync_interval=H, comm_dtype="fp16"),
        "dense": dict(compress_ratio=1.0, sync_interval=1, bias_correction_form="full"),  # T2
    }[name]


def _property_worker(rank: int, world_size: int, scenarios: list[str]) -> dict[str, list[dict]]:
    """Run each scenario with predetermined gradients (the parameters diverge, so no autograd)."""
    torch.set_num_threads(1)
    out = {}
    for name in scenarios:
        params = [nn.Parameter(t.clone()) for t in initial_params()]
        comm = Comm()
        optimizer = SLAMB([{"params": params[:4], "weight_decay": 0.01}, {"params": params[4:], "weight_decay": 0.0}],
                          comm=comm, **_scenario_options(name))
        records = []
        for step in range(1, N_STEPS + 1):
            for i, p in enumerate(params):
                p.grad = grad(0 if name == "dense" else rank, step, i)
            rng = torch.get_rng_state()
            optimizer.step()
            counts = comm.take_counts()
            records.append(dict(
                rng_unchanged=torch.equal(rng, torch.get_rng_state()),
                m=[optimizer.state[p]["exp_avg"].clone() for p in params],
                r=optimizer.freshness(),
                masks=optimizer.sync_masks(step),
                params=[p.detach().clone() for p in params],
                bytes=counts["bytes"], collectives=counts["collectives"],
                agree=get_optimizer_spec("slamb").replicas_agree_after(optimizer, step),
            ))
        out[name] = records
    return out


@functools.cache
def _ranks(world_size: int) -> dict[str, list[list[dict]]]:
    """scenario -> rank -> step records, from one multi-process run per world size."""
    results = run_on_ranks(_property_worker, world_size, ["bernoulli", "cyclic", "fp16", "dense"])
    return {name: [r[name] for r in results] for name in results[0]}


def _check_properties(ranks: list[list[dict]], world_size: int, element_size: int, exact: bool) -> None:
    d = sum(math.prod(s) for s in SHAPES)
    d_small = sum(math.prod(s) for s in SHAPES if len(s) == 1 or math.prod(s) < MIN_NUMEL)
    grads = [[[grad(r, t, i).double() for i in range(len(SHAPES))] for t in range(1, N_STEPS + 1)]
             for r in range(world_size)]
    global_m = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    local_m = [[torch.zeros(s, dtype=torch.float64) for s in SHAPES] for _ in range(world_size)]
    staleness = [torch.zeros(s) for s in SHAPES]
    tol = dict(rtol=1e-5, atol=1e-6) if exact else dict(rtol=2e-2, atol=2e-3)
    selected_per_step = []
    for t in range(N_STEPS):
        records = [ranks[r][t] for r in range(world_size)]
        masks = records[0]["masks"]
        for record in records:  # T4: identical masks everywhere, global RNG untouched
            assert record["rng_unchanged"]
            assert all(torch.equal(a, b) for a, b in zip(record["masks"], masks, strict=True))
        for i in range(len(SHAPES)):
            mean_grad = sum(grads[r][t][i] for r in range(world_size)) / world_size
            global_m[i] = BETA1 * global_m[i] + (1 - BETA1) * mean_grad
            for r in range(world_size):
                local_m[r][i] = BETA1 * local_m[r][i] + (1 - BETA1) * grads[r][t][i]
            averaged = sum(local_m[r][i] for r in range(world_size)) / world_size
            for r in range(world_size):
                local_m[r][i] = torch.where(masks[i], averaged, local_m[r][i])
                m = records[r]["m"][i].double()
                # T3: at the synced coordinates, the momentum of the mean gradient, however stale they were;
                # elsewhere, the rank's own EMA since its last sync.
                torch.testing.assert_close(m[masks[i]], global_m[i][masks[i]], **tol)
                torch.testing.assert_close(m, local_m[r][i], **tol)
            staleness[i].add_(1).masked_fill_(masks[i], 0)
            for record in records:  # T5
                torch.testing.assert_close(record["r"][i], BETA3**staleness[i], rtol=2 * FP16_ROUNDING, atol=0)
        assert all(masks[i].all() for i, s in enumerate(SHAPES) if len(s) == 1 or math.prod(s) < MIN_NUMEL)

        # T6: bytes = |S_t| (always-synced included) x payload size, plus 4 d on a dense-sync step.
        selected = sum(int(m.sum()) for m in masks)
        selected_per_step.append(selected - d_small)
        dense_sync = t % H == 0  # after steps 1, 1 + H, ... (sync_offset 1)
        expected = (selected * element_size + 4 * d * dense_sync) if world_size > 1 else 0
        assert [rec["bytes"] for rec in records] == [expected] * world_size

        # T7: identical parameters right after a dense sync, different in between; always-synced momenta agree.
        same = [all(torch.equal(a, b) for a, b in zip(rec["params"], records[0]["params"], strict=True))
                for rec in records]
        if dense_sync or world_size == 1:
            assert all(same)
        else:
            assert not any(same[1:])
        assert all(rec["agree"] == all(same) for rec in records)  # declared exactly where bit-identical
        for i, shape in enumerate(SHAPES):
            if len(shape) == 1 or math.prod(shape) < MIN_NUMEL:
                assert all(torch.equal(rec["m"][i], records[0]["m"][i]) for rec in records)
    d_big = d - d_small
    mean = sum(selected_per_step) / len(selected_per_step)
    assert abs(mean - K * d_big) < 5 * math.sqrt(d_big * K * (1 - K) / N_STEPS)  # T11: ~k d_big, not (1-k) d_big


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_properties_on_gloo_ranks(world_size):
    ranks = _ranks(world_size)
    _check_properties(ranks["bernoulli"], world_size, element_size=4, exact=True)
    _check_properties(ranks["cyclic"], world_size, element_size=4, exact=True)
    _check_properties(ranks["fp16"], world_size, element_size=2, exact=False)  # T3 only approximately


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_momentum_goes_out_in_buckets(world_size):
    """Each chunk's compact momentum in all-reduces of at most bucket_mb: here one chunk per param group."""
    bucket = int(0.002 * 2**20) // 4
    for t, record in enumerate(_ranks(world_size)["bernoulli"][0]):
        if t % H:  # no dense sync: only the bucketed momentum all-reduces
            groups = record["masks"][:4], record["masks"][4:]
            buckets = [math.ceil(sum(int(m.sum()) for m in masks) / bucket) for masks in groups]
            assert record["collectives"] == sum(buckets) and buckets[0] > 1


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_identical_data_k_1_and_h_1_equals_lamb(world_size):
    """T2: with the same gradients on every rank, k = 1 and H = 1, SLAMB is LAMB (v and clipping agree)."""
    params = [nn.Parameter(t.clone()) for t in initial_params()]
    lamb = LAMB([{"params": params[:4], "weight_decay": 0.01}, {"params": params[4:], "weight_decay": 0.0}],
                lr=1e-2, always_adapt=True, max_grad_norm=None)
    for step in range(1, N_STEPS + 1):
        for i, p in enumerate(params):
            p.grad = grad(0, step, i)
        lamb.step()
    for record in _ranks(world_size)["dense"]:
        for got, want in zip(record[-1]["params"], params, strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- trainer
SLAMB_RUN = [*TINY, "trainer.nproc_per_node=2", "optim=slamb", "optim.min_compress_numel=500",
             "optim.sync_interval=4", "trainer.max_steps=10", "trainer.checkpoint_every=3", "data.masking=dynamic"]


@pytest.mark.slow
def test_two_rank_run_killed_and_resumed_repeats_the_loss_series_and_bytes_match_the_masks(tmp_path):
    reference = run_train([*SLAMB_RUN, f"hydra.run.dir={tmp_path / 'ref'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    proc = popen_train([*SLAMB_RUN, f"hydra.run.dir={killed_dir}"], new_session=True)
    wait_for_step(killed_dir, 7, proc)  # past the checkpoint at 6, between the dense syncs at 5 and 9
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = run_train([*SLAMB_RUN, f"hydra.run.dir={killed_dir}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    def series(run_dir):
        return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"], r["comm_bytes_per_step"])
                for r in read_metrics(run_dir)]

    assert series(killed_dir) == series(tmp_path / "ref")  # bit-identical, every step once
    assert len(series(killed_dir)) == 10

    # The bytes the trainer logged are |S_t| fp32 momenta, plus every fp32 parameter after steps 1, 5, 9.
    cfg = compose(SLAMB_RUN)
    from train.model_init import build_model

    model = build_model(cfg.model.name, validate(cfg).model_options, None, None)
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.optim).items() if k != "name"}
    masks_of = build_optimizer(model, "slamb", kwargs).sync_masks  # masks depend on shapes, seed and step only
    d = sum(p.numel() for p in model.parameters())
    for record in read_metrics(tmp_path / "ref"):
        t = record["step"]
        selected = sum(int(m.sum()) for m in masks_of(t))
        assert record["comm_bytes_per_step"] == 4 * selected + 4 * d * ((t - 1) % 4 == 0)
        assert record["comm_collectives_per_step"] >= 1


def _fp16_overflow_worker(rank: int, world_size: int, run_dir: str, overrides: list[str]) -> list[tuple]:
    """Four trainer steps under fp16 on this rank; at the third, rank 1 alone sees an inf gradient."""
    from train.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(plan_run(compose([*overrides, f"trainer.nproc_per_node={world_size}"]), run_dir), Comm())
    out = []
    for i in range(4):
        handle = None
        if i == 2 and rank == 1:
            weight = trainer.model.get_input_embeddings().weight
            handle = weight.register_hook(lambda g: torch.full_like(g, math.inf))
        metrics = trainer.train_step()
        if handle is not None:
            handle.remove()
        trainer.step += 0 if metrics["skipped"] else 1
        out.append((metrics["skipped"], trainer.scaler.get_scale(), trainer.optimizer.state["slamb"]["step"],
                    metrics["bytes"], trainer.model.bert.pooler.dense.weight.detach().clone()))
    trainer.close()
    return out


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_all(tmp_path):
    overrides = [*TINY, "optim=slamb", "precision=fp16", "precision.init_scale=256.0", "optim.min_compress_numel=500"]
    ranks = run_on_ranks(_fp16_overflow_worker, 2, str(tmp_path), overrides)
    for step in range(4):
        (skip0, scale0, t0, bytes0, _), (skip1, scale1, t1, bytes1, _) = ranks[0][step], ranks[1][step]
        assert (skip0, scale0, t0, bytes0) == (skip1, scale1, t1, bytes1)  # the same branch on both ranks
    assert ranks[0][2][0] and ranks[0][2][3] == 0  # the injected inf skipped the step: no SLAMB traffic
    assert ranks[0][2][1] == ranks[0][1][1] / 2  # and halved the loss scale
    assert ranks[0][2][2] == ranks[0][1][2]  # the optimizer did not advance
    assert not ranks[0][3][0] and ranks[0][3][2] == ranks[0][1][2] + 1
    assert torch.equal(ranks[0][2][4], ranks[0][1][4])  # parameters untouched by the skipped step


@pytest.mark.parametrize("experiment", ["bert_large_phase1_slamb", "bert_large_phase2_slamb"])
def test_bert_slamb_experiments_train_at_test_scale(tmp_path, experiment):
    from train.run import run

    cfg = compose([f"experiment={experiment}", "data=demo", *TINY, "trainer.max_steps=2", "trainer.init_from=null"])
    assert (cfg.optim.name, cfg.optim.compress_ratio, cfg.optim.sync_interval) == ("slamb", 0.1, 100)
    run(cfg, tmp_path)
    # fp16 with the recipe's initial loss scale 2^20: the first steps overflow, are skipped and logged at step 0.
    assert [r["step"] for r in read_metrics(tmp_path) if r["step"] > 0] == [1, 2]


def test_bert_slamb_experiments_send_the_momentum_in_fp16():
    """As the authors' BERT fork: the masked momentum goes out in fp16, the dense parameter average in fp32."""
    for experiment in ("slamb_bert", "bert_large_phase1_slamb", "bert_large_phase2_slamb"):
        assert compose([f"experiment={experiment}"]).optim.comm_dtype == "fp16", experiment
