"""SLAMB's single-tensor reference: it equals the official Slamb and Slamb_V2, and the fast path equals it on 1, 2
and 4 gloo ranks with distinct gradients for every mask, rescale form, bias-correction form and precision."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.config import optim_preset
from helpers.distributed_harness import run_on_ranks
from helpers.slamb_cases import BETA3, MIN_NUMEL, N_STEPS, SHAPES, H, K, grad, initial_params
from torch import nn

from optim import SLAMB
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.slamb import reference

WDS = [0.01] * 4 + [0.0]  # the two param groups of every test here: four tensors with decay, then the 1-D one
# always_adapt=False tests: the no-decay group holds a masked matrix, the small matrix and the 1-D tensor
NVLAMB_WDS = [0.01] * 2 + [0.0] * 3
RANK_SEEDS = {1: [0], 2: [0, 1], 4: [0, 1, 2, 3]}


def _groups(params: list[torch.Tensor], wds: list[float] = WDS) -> list[dict]:
    """A decay group, then a no-decay group, as `wds` splits the tensors (in order, so masks keep their index)."""
    split = wds.index(0.0)
    return [{"params": params[:split], "weight_decay": wds[0]}, {"params": params[split:], "weight_decay": 0.0}]


# --------------------------------------------------------------------------------------------- official code
def _ratio(weight: torch.Tensor, update: torch.Tensor, fallback: float) -> torch.Tensor:
    w, u = weight.norm(), update.norm()
    return w / u if w > 0 and u > 0 else torch.tensor(fallback)


def _average_(tensors: list[torch.Tensor], where: torch.Tensor | None = None) -> None:
    """all_reduce, then div_(world_size), as both official classes average (the momentum at `where`)."""
    if where is None:
        mean = sum(tensors[1:], tensors[0].clone()) / len(tensors)
        for x in tensors:
            x.copy_(mean)
    else:
        mean = sum((x[where] for x in tensors[1:]), tensors[0][where].clone()) / len(tensors)
        for x in tensors:
            x[where] = mean


def _official_v2(params, grads, masks, wds, *, lr, betas, eps, beta3, bounds, interval) -> None:
    """Slamb_V2's step, transcribed tensor by tensor and rank by rank (`params[i][rank]`, `grads[t][i][rank]`),
    with the masks given.

    Bias correction as one scalar; norms over the Adam direction without decay; phi_F over the coordinates whose
    freshness is 1 (fallback 1, clamp [c_min, c_max]), phi_U over the others (fallback 0, clamp [0, c_max]);
    w -= lr phi_F r u + lr / sqrt(N) phi_U (1 - r) u with u including the decay.
    """
    beta1, beta2 = betas
    world_size = len(params[0])
    state = {}
    for t, (step_grads, step_masks) in enumerate(zip(grads, masks, strict=True), start=1):
        for i, (ranks, rank_grads, mask, wd) in enumerate(zip(params, step_grads, step_masks, wds, strict=True)):
            ms, vs, r = state.setdefault(i, ([torch.zeros_like(p) for p in ranks], [torch.zeros_like(p) for p in ranks],
                                             torch.ones_like(ranks[0])))
            for m, v, g in zip(ms, vs, rank_grads, strict=True):
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            r.mul_(beta3)
            r[mask] = 1.0
            fresh = r == 1
            _average_(ms, fresh)
            for p, m, v in zip(ranks, ms, vs, strict=True):
                u = m / (v.sqrt() + eps) * ((1 - beta2**t) ** 0.5 / (1 - beta1**t))
                phi_f = _ratio(p[fresh], u[fresh], 1.0).clamp(*bounds)
                phi_u = _ratio(p[~fresh], u[~fresh], 0.0).clamp(0.0, bounds[1])
                u = u + wd * p
                p.sub_(lr * phi_f * u * r + lr / math.sqrt(world_size) * phi_u * u * (1 - r))
        if t % interval == 1:
            for ranks in params:
                _average_(ranks)


def _official_naive(params, grads, masks, wds, *, lr, betas, eps, beta3, bounds, interval) -> None:
    """The naive Slamb's step, transcribed as `_official_v2`: full bias correction, decay inside the norms,
    staleness counters, phi = clamp(r phi_F + (1 - r) phi_U, c_min, c_max) over the raw ratios (fallback 1),
    1-D tensors unclamped."""
    beta1, beta2 = betas
    world_size = len(params[0])
    state = {}
    for t, (step_grads, step_masks) in enumerate(zip(grads, masks, strict=True), start=1):
        for i, (ranks, rank_grads, mask, wd) in enumerate(zip(params, step_grads, step_masks, wds, strict=True)):
            ms, vs, j = state.setdefault(i, ([torch.zeros_like(p) for p in ranks], [torch.zeros_like(p) for p in ranks],
                                             torch.zeros_like(ranks[0])))
            for m, v, g in zip(ms, vs, rank_grads, strict=True):
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            _average_(ms, mask)
            j.add_(1).mul_(~mask)
            for p, m, v in zip(ranks, ms, vs, strict=True):
                u = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + wd * p
                if p.dim() == 1:
                    p.sub_(lr * _ratio(p, u, 1.0) * u)
                    continue
                r = beta3**j
                phi = (r * _ratio(p[mask], u[mask], 1.0) + (1 - r) * _ratio(p[~mask], u[~mask], 1.0)).clamp(*bounds)
                p.sub_(phi * (r * lr + (1 - r) * lr / math.sqrt(world_size)) * u)
        if t % interval == 1:
            for ranks in params:
                _average_(ranks)


def _official_options(options: dict) -> dict:
    return dict(lr=options["lr"], betas=tuple(options["betas"]), eps=options["eps"], beta3=options["beta3"],
                bounds=tuple(options["trust_ratio_bounds"]), interval=options["sync_interval"])


def _compare_with_official(official, options: dict, world_size: int, shrink_fresh: bool = False) -> None:
    """SLAMB with `options` on N identical (mirrored) ranks against `official` fed SLAMB's own masks."""
    params = [nn.Parameter(t.clone()) for t in initial_params()]
    optimizer = SLAMB(_groups(params), comm=MirrorComm(world_size), **options)
    masks = [optimizer.sync_masks(t) for t in range(1, N_STEPS + 1)]
    if shrink_fresh:  # phi_F far below c_min at step 1: clamping before or after the interpolation differs
        with torch.no_grad():
            for p, mask in zip(params, masks[0], strict=True):
                if p.dim() > 1 and not mask.all():
                    p[mask] *= 1e-4
    expected = [[p.detach().clone() for _ in range(world_size)] for p in params]
    grads = [[grad(0, t, i) for i in range(len(SHAPES))] for t in range(1, N_STEPS + 1)]
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        optimizer.step()
    official(expected, [[[g] * world_size for g in step_grads] for step_grads in grads], masks, WDS,
             **_official_options(options))
    for got, want in zip(params, expected, strict=True):
        torch.testing.assert_close(got.detach(), want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [1, 4])
def test_v2_official_preset_equals_the_official_slamb_v2_step(world_size):
    options = optim_preset("slamb_v2_official") | dict(compress_ratio=K, min_compress_numel=MIN_NUMEL,
                                                       sync_interval=H, beta3=BETA3, lr=1e-2)
    assert options["wd_in_trust_ratio"] is False and options["mask"] == "bernoulli"
    _compare_with_official(_official_v2, options, world_size)


NAIVE = dict(mask="cyclic", rescale="product_of_interpolations", bias_correction_form="full",
             stale_ratio_fallback=1, clamp_1d=False, wd_in_trust_ratio=True,
             freshness_dtype="fp32")  # the naive Slamb counts staleness exactly; fp16 r is within 2^-11 of it


@pytest.mark.parametrize("shrink_fresh", [False, True])
def test_naive_switches_equal_the_official_naive_slamb_step(shrink_fresh):
    """The product form interpolates the raw ratios and clamps the result, as the official naive Slamb."""
    options = optim_preset("slamb") | dict(compress_ratio=K, min_compress_numel=MIN_NUMEL, sync_interval=H,
                                           beta3=BETA3, lr=1e-2, **NAIVE)
    _compare_with_official(_official_naive, options, 4, shrink_fresh=shrink_fresh)


# --------------------------------------------------------------------------------------------- the reference
def _run_reference(options: dict, world_size: int, masks: list[list[torch.Tensor]], steps: int,
                   dtype: torch.dtype = torch.float32, wds: list[float] = WDS) -> list[reference.ParamState]:
    """The reference over `steps` steps from `initial_params`, rank r drawing `grad(r, t, i)`."""
    params = [reference.ParamState.replicated(p.to(dtype), world_size, wd)
              for p, wd in zip(initial_params(), wds, strict=True)]
    for t in range(1, steps + 1):
        grads = [[grad(rank, t, i).to(dtype) for rank in range(world_size)] for i in range(len(SHAPES))]
        reference.step(params, grads, masks[t - 1], t, **options)
    return params


def _run_official(official, options: dict, world_size: int, masks: list[list[torch.Tensor]], steps: int,
                  dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    params = [[p.to(dtype, copy=True) for _ in range(world_size)] for p in initial_params()]
    grads = [[[grad(rank, t, i).to(dtype) for rank in range(world_size)] for i in range(len(SHAPES))]
             for t in range(1, steps + 1)]
    official(params, grads, masks[:steps], WDS, **_official_options(options))
    return params


def _masks_of(options: dict, steps: int) -> list[list[torch.Tensor]]:
    optimizer = SLAMB(_groups([nn.Parameter(t) for t in initial_params()]), **options)
    return [optimizer.sync_masks(t) for t in range(1, steps + 1)]


V2 = dict(compress_ratio=K, min_compress_numel=MIN_NUMEL, sync_interval=H, beta3=BETA3, lr=1e-2)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("preset", "switches", "official"), [("slamb_v2_official", {}, _official_v2),
                                                              ("slamb", NAIVE, _official_naive)], ids=["v2", "naive"])
def test_reference_equals_the_official_step_with_distinct_gradients(world_size, preset, switches, official):
    options = optim_preset(preset) | V2 | switches
    masks = _masks_of(options, N_STEPS)
    got = _run_reference(options, world_size, masks, N_STEPS)
    want = _run_official(official, options, world_size, masks, N_STEPS)
    for param, ranks in zip(got, want, strict=True):
        for w, expected in zip(param.weights, ranks, strict=True):
            torch.testing.assert_close(w, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- fast path
def _fast_path_configs() -> dict[str, dict]:
    """Every mask x rescale form x bias-correction form, and every precision (momentum wire, freshness storage)
    with both rescale forms; a sync every H steps."""
    base = dict(optim_preset("slamb"), **V2, seed=7)
    configs = {}
    for mask in ("stratified", "bernoulli", "cyclic"):
        for rescale in ("sum_of_products", "product_of_interpolations"):
            for form in ("scalar", "full", "none"):
                configs[f"{mask}-{rescale}-{form}"] = dict(base, mask=mask, rescale=rescale, bias_correction_form=form)
    for rescale in ("sum_of_products", "product_of_interpolations"):
        for comm_dtype, freshness_dtype in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "fp32")):
            configs[f"{rescale}-{comm_dtype}-{freshness_dtype}"] = dict(base, rescale=rescale, comm_dtype=comm_dtype,
                                                                       freshness_dtype=freshness_dtype)
    configs["v2_official"] = optim_preset("slamb_v2_official") | V2
    configs["naive"] = dict(base, **NAIVE)
    return configs


FAST_STEPS = 6  # two dense syncs (after steps 1 and 5)


def _fast_path_worker(rank: int, world_size: int, always_adapt: bool = True,
                      ) -> dict[str, tuple[list[torch.Tensor], list[list[torch.Tensor]]]]:
    """Every configuration of `_fast_path_configs` (always_adapt=False: of `_nvlamb_configs`, with its groups) on
    this rank: (parameters after the last step, masks)."""
    configs, wds = (_fast_path_configs(), WDS) if always_adapt else (_nvlamb_configs(), NVLAMB_WDS)
    out = {}
    for name, options in configs.items():
        params = [nn.Parameter(t.clone()) for t in initial_params()]
        optimizer = SLAMB(_groups(params, wds), comm=Comm(), **options)
        for t in range(1, FAST_STEPS + 1):
            for i, p in enumerate(params):
                p.grad = grad(rank, t, i)
            optimizer.step()
        out[name] = [p.detach().clone() for p in params], [optimizer.sync_masks(t) for t in range(1, FAST_STEPS + 1)]
    return out


@functools.cache
def _fast_path_ranks(world_size: int) -> list[dict]:
    return run_on_ranks(_fast_path_worker, world_size)


def _tolerance(options: dict) -> dict:
    """fp32 rounding; a 16-bit payload's (each rank's share and the partial sums are rounded to it, in another
    order than gloo's: bf16's 2^-8 in the averaged momentum, at an outlier of u whose step is near the weight's
    size, is 6e-3 of the weight); or an fp16 freshness's, 2^-11 relative in r, which the product form carries
    into the whole coefficient."""
    if options["comm_dtype"] == "bf16":
        return dict(rtol=1e-2, atol=1e-3)
    if options["comm_dtype"] == "fp16" or options["freshness_dtype"] == "fp16":
        return dict(rtol=1e-3, atol=1e-5)
    return dict(rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fast_path_equals_the_reference_on_gloo_ranks_with_distinct_gradients(world_size):
    """Each rank draws its own gradients; the reference runs every rank in one process and averages itself."""
    ranks = _fast_path_ranks(world_size)
    for name, options in _fast_path_configs().items():
        masks = ranks[0][name][1]
        assert all(all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
                   for rank in ranks for mine, theirs in zip(rank[name][1], masks, strict=True))
        expected = _run_reference(options, world_size, masks, FAST_STEPS)
        for rank, results in enumerate(ranks):
            for i, (got, param) in enumerate(zip(results[name][0], expected, strict=True)):
                torch.testing.assert_close(got, param.weights[rank], **_tolerance(options),
                                           msg=lambda m, name=name, rank=rank, i=i: f"{name} rank {rank} {i}: {m}")


# --------------------------------------------------------------------------------------------- always_adapt
def _nvlamb_configs() -> dict[str, dict]:
    """always_adapt=False with both rescale forms, fp32 throughout (the reference's precision)."""
    base = dict(optim_preset("slamb"), **V2, seed=7, always_adapt=False, freshness_dtype="fp32")
    return {rescale: dict(base, rescale=rescale) for rescale in ("sum_of_products", "product_of_interpolations")}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_fast_path_without_always_adapt_equals_the_reference(world_size):
    """No trust ratio on the no-decay group (a masked matrix among it): the fast path on gloo ranks with distinct
    gradients equals the reference, whose no-decay tensors differ from the always_adapt=True ones."""
    ranks = run_on_ranks(_fast_path_worker, world_size, False)
    for name, options in _nvlamb_configs().items():
        masks = ranks[0][name][1]
        expected = _run_reference(options, world_size, masks, FAST_STEPS, wds=NVLAMB_WDS)
        adapted = _run_reference(dict(options, always_adapt=True), world_size, masks, FAST_STEPS, wds=NVLAMB_WDS)
        for i, wd in enumerate(NVLAMB_WDS):
            for rank, results in enumerate(ranks):
                torch.testing.assert_close(results[name][0][i], expected[i].weights[rank], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, name=name, rank=rank, i=i: f"{name} rank {rank} {i}: {m}")
            assert torch.equal(expected[i].weights[0], adapted[i].weights[0]) == (wd != 0), (name, i)


# --------------------------------------------------------------------------------------------- stale norms
def _first_step_worker(rank: int, world_size: int, options: dict) -> list[torch.Tensor]:
    params = [nn.Parameter(t.clone()) for t in initial_params()]
    optimizer = SLAMB(_groups(params), comm=Comm(), **options)
    for i, p in enumerate(params):
        p.grad = grad(rank, 1, i)
    optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.slow
def test_stale_steps_stay_within_rounding_when_distinct_gradients_give_fresh_outliers():
    """The naive form on 4 ranks with distinct gradients against a float64 reference, at step 1, where the fresh
    direction has outliers (at S_t the averaged momentum meets the local v: a mean gradient over one rank's |g|),
    so ||u_F||^2 / ||u_U||^2 reaches 523 here. A stale norm formed as sqrt(||u||^2 - ||u_F||^2) multiplies its
    fp32 rounding by that factor (measured on these draws: stale steps up to 2.9e-4 of their size off); SLAMB
    takes the stale norm directly, and every stale step stays within 2.1e-5 whatever the factor (fresh: 2.7e-6)."""
    options = optim_preset("slamb") | V2 | NAIVE | dict(sync_offset=0)  # no dense sync after step 1
    world_size = 4
    ranks = run_on_ranks(_first_step_worker, world_size, options)
    masks = _masks_of(options, 1)
    expected = _run_reference(options, world_size, masks, 1, torch.float64)
    initial = initial_params()
    factors = []
    for i in range(3):  # the masked tensors
        mask, w0 = masks[0][i], initial[i].double()
        grads = [grad(rank, 1, i).double() for rank in range(world_size)]
        for rank in range(world_size):
            m = grads[rank].clone()  # m_hat at step 1: the local gradient, the rank mean at S_t
            m[mask] = (sum(grads) / world_size)[mask]
            u = m / (grads[rank].abs() + options["eps"]) + WDS[i] * w0
            factor = float(u[mask].square().sum() / u[~mask].square().sum())
            factors.append(factor)
            got, want = ranks[rank][i].double(), expected[i].weights[rank]
            step = want - w0
            fresh_error = float((got - want)[mask].norm() / step[mask].norm())
            stale_error = float((got - want)[~mask].norm() / step[~mask].norm())
            assert fresh_error < 1e-5, (i, rank, fresh_error)
            assert stale_error < 5e-5, (i, rank, stale_error, factor)  # the same bound at any factor
    assert max(factors) > 100  # mirrored ranks (u_F and u_U alike) never get there
