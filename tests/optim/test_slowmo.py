"""SlowMo: the outer recursion against a transcription on 1, 2 and 4 gloo ranks, data parallelism at tau = 1 with
an SGD base, identical replicas after every sync, bytes per step, exact resume mid-cycle, the LR reaching the base,
no host reads, config errors."""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
from helpers.config import compose
from helpers.distributed_harness import run_on_ranks
from helpers.host_reads import count_host_reads
from torch import nn

from core.errors import ConfigError
from optim import LAMB, LARS, SlowMo, build_optimizer, check_optimizer_config
from optim.comm import Comm

SHAPES = [(30, 40), (40,), (20, 30), (20,), (7, 3, 2)]
D = sum(math.prod(shape) for shape in SHAPES)
STEPS = 9
BASES = {  # a base and its options, as `SlowMo(base=..., base_options=...)` takes them, and its class
    "sgd": (torch.optim.SGD, dict(momentum=0.9, nesterov=True)),
    "adamw": (torch.optim.AdamW, dict(betas=(0.9, 0.99))),
    "lamb": (LAMB, dict(max_grad_norm=None)),
    "lars": (LARS, dict(momentum=0.9, trust_coefficient=0.02)),
}
SCENARIOS = {  # base, sync_interval, slow_momentum, slow_lr, average_buffers
    "sgd_tau3": ("sgd", 3, 0.5, 0.8, False),
    "lamb_tau2_buffers": ("lamb", 2, 0.6, 1.0, True),
    "lars_tau4": ("lars", 4, 0.3, 1.0, False),
    "sgd_dp": ("sgd", 1, 0.0, 1.0, False),  # = data-parallel SGD
    "adamw_tau1": ("adamw", 1, 0.0, 1.0, False),  # = AdamW with averaging after every step, not DP AdamW
    "sgd_buffers_small_buckets": ("sgd", 2, 0.5, 1.0, True),
}
SMALL_BUCKET_MB = 0.004  # 1048 fp32: the 2,118 parameters go out in three all-reduces


def _initial() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g) * 0.1 for shape in SHAPES]


def _grad(rank: int, step: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + index)
    return torch.randn(SHAPES[index], generator=g) * 0.1


def _lr(base: str, step: int) -> float:
    """A changing LR, 0 at step 6 (a sync step of sgd_tau3 and lamb_tau2_buffers: the lr -> 0 limit)."""
    peak = 0.1 if base in ("sgd", "lars") else 1e-2
    return 0.0 if step == 6 else peak * (1.0 - step / 20)


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]


def _slowmo(params: list[nn.Parameter], scenario: str, comm: Comm | None = None) -> SlowMo:
    base, tau, beta, alpha, buffers = SCENARIOS[scenario]
    bucket_mb = SMALL_BUCKET_MB if scenario == "sgd_buffers_small_buckets" else 64.0
    return SlowMo(_groups(params), lr=_lr(base, 1), base=base, base_options=BASES[base][1], sync_interval=tau,
                  slow_momentum=beta, slow_lr=alpha, average_buffers=buffers, bucket_mb=bucket_mb, comm=comm)


def _run(scenario: str, optimizer: SlowMo, params: list[nn.Parameter], rank: int, steps: range,
         comm: Comm | None) -> list[dict]:
    """`steps` with this rank's gradients and the scenario's schedule; per step the parameters and comm counts."""
    records = []
    base = SCENARIOS[scenario][0]
    for step in steps:
        for group in optimizer.param_groups:  # what the trainer's schedule does
            group["lr"] = _lr(base, step)
        for i, p in enumerate(params):
            p.grad = _grad(rank, step, i)
        optimizer.step()
        counts = comm.take_counts() if comm is not None else {}
        records.append(dict(params=[p.detach().clone() for p in params], **counts))
    return records


def _worker(rank: int, world_size: int) -> dict:
    """Every scenario on this rank; each also resumes from a mid-cycle state_dict (after step 4)."""
    torch.set_num_threads(1)
    out = {}
    for scenario in SCENARIOS:
        params = [nn.Parameter(t.clone()) for t in _initial()]
        comm = Comm()
        optimizer = _slowmo(params, scenario, comm)
        records = _run(scenario, optimizer, params, rank, range(1, 5), comm)
        buffer = io.BytesIO()
        torch.save({"params": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
        records += _run(scenario, optimizer, params, rank, range(5, STEPS + 1), comm)

        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        resumed_params = [nn.Parameter(t.clone()) for t in saved["params"]]
        resumed = _slowmo(resumed_params, scenario, Comm())
        resumed.load_state_dict(saved["optimizer"])
        resumed_records = _run(scenario, resumed, resumed_params, rank, range(5, STEPS + 1), None)
        out[scenario] = dict(records=records, resumed=[r["params"] for r in resumed_records])
    return out


@functools.cache
def _ranks(world_size: int) -> dict:
    return run_on_ranks(_worker, world_size)


def _reference(scenario: str, world_size: int) -> list[list[list[torch.Tensor]]]:
    """Per step, per rank, the parameters: N replicas of the base and the SlowMo recursion, one tensor at a time."""
    base, tau, beta, alpha, average_buffers = SCENARIOS[scenario]
    cls, options = BASES[base]
    replicas = [[nn.Parameter(t.clone()) for t in _initial()] for _ in range(world_size)]
    optimizers = [cls(_groups(params), lr=_lr(base, 1), **options) for params in replicas]
    anchor = [t.clone() for t in _initial()]
    u = [torch.zeros_like(t) for t in anchor]
    history = []
    for step in range(1, STEPS + 1):
        lr = _lr(base, step)
        for rank, (params, optimizer) in enumerate(zip(replicas, optimizers, strict=True)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            for i, p in enumerate(params):
                p.grad = _grad(rank, step, i)
            optimizer.step()
        if step % tau == 0:
            with torch.no_grad():
                for i in range(len(SHAPES)):
                    mean = sum(params[i] for params in replicas) / world_size
                    if lr > 0:
                        u[i] = beta * u[i] + (anchor[i] - mean) / lr
                        anchor[i] = anchor[i] - alpha * lr * u[i]
                    else:  # the limit lr -> 0
                        u[i] = beta * u[i]
                        anchor[i] = anchor[i] - alpha * (anchor[i] - mean)
                    for params in replicas:
                        params[i].copy_(anchor[i])
                    if average_buffers:
                        states = [optimizer.state[params[i]] for optimizer, params in zip(optimizers, replicas,
                                                                                            strict=True)]
                        for key in states[0]:
                            if key != "step" and states[0][key].shape == SHAPES[i]:
                                mean_state = sum(state[key] for state in states) / world_size
                                for state in states:
                                    state[key].copy_(mean_state)
        history.append([[p.detach().clone() for p in params] for params in replicas])
    return history


def _buffers_per_param(base: str) -> int:
    return {"sgd": 1, "lars": 1, "adamw": 2, "lamb": 2}[base]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_recursion_replicas_bytes_and_resume_on_gloo_ranks(world_size, scenario):
    base, tau, _, _, average_buffers = SCENARIOS[scenario]
    ranks = [r[scenario] for r in _ranks(world_size)]
    reference = _reference(scenario, world_size)
    for step in range(1, STEPS + 1):
        records = [r["records"][step - 1] for r in ranks]
        for rank, record in enumerate(records):
            for i, (got, want) in enumerate(zip(record["params"], reference[step - 1][rank], strict=True)):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6,
                                           msg=lambda m, i=i, step=step: f"step {step}, tensor {i}: {m}")
        synced = step % tau == 0
        same = [all(torch.equal(a, b) for a, b in zip(r["params"], records[0]["params"], strict=True))
                for r in records]
        if synced or world_size == 1:
            assert all(same), step  # bit-identical replicas after every outer step
        else:
            assert not any(same[1:]), step
        # 32 bits per parameter at a sync (+ the base's state tensors when they are averaged), nothing else.
        per_param = 1 + average_buffers * _buffers_per_param(base)
        expected = 4 * D * per_param if synced and world_size > 1 else 0
        assert [r["bytes"] for r in records] == [expected] * world_size, step
        buckets = math.ceil(per_param * D / (SMALL_BUCKET_MB * 2**20 / 4)) if "small_buckets" in scenario else 1
        assert all(r["collectives"] in ((buckets, buckets + 1) if synced and world_size > 1 else (0,))
                   for r in records), step
    for rank in ranks:  # resumed mid-cycle (after step 4) from a state_dict: the same trajectory, bit for bit
        for got, want in zip(rank["resumed"], rank["records"][4:], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(got, want["params"], strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tau_1_beta_0_alpha_1_with_an_sgd_base_is_data_parallel_sgd(world_size):
    """SGD steps (momentum, Nesterov, decay) are linear in the gradient, so averaging the weights after each
    local step equals stepping on the averaged gradient."""
    params = [nn.Parameter(t.clone()) for t in _initial()]
    sgd = torch.optim.SGD(_groups(params), lr=_lr("sgd", 1), **BASES["sgd"][1])
    ranks = _ranks(world_size)
    for step in range(1, STEPS + 1):
        for group in sgd.param_groups:
            group["lr"] = _lr("sgd", step)
        for i, p in enumerate(params):
            p.grad = sum(_grad(rank, step, i) for rank in range(world_size)) / world_size
        sgd.step()
        for rank in ranks:
            for got, want in zip(rank["sgd_dp"]["records"][step - 1]["params"], params, strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tau_1_with_an_adaptive_base_is_not_data_parallel(world_size):
    """AdamW is not linear in the gradient: averaging after each local step differs from AdamW on the average
    (what holds instead, the base with periodic averaging, is the recursion test above)."""
    params = [nn.Parameter(t.clone()) for t in _initial()]
    adamw = torch.optim.AdamW(_groups(params), lr=_lr("adamw", 1), **BASES["adamw"][1])
    for step in range(1, 4):
        for group in adamw.param_groups:
            group["lr"] = _lr("adamw", step)
        for i, p in enumerate(params):
            p.grad = sum(_grad(rank, step, i) for rank in range(world_size)) / world_size
        adamw.step()
    got = _ranks(world_size)[0]["adamw_tau1"]["records"][2]["params"]
    assert (got[0] - params[0]).abs().max() > 1e-4


@pytest.mark.parametrize("base", list(BASES))
def test_one_rank_tau_1_beta_0_alpha_1_is_the_base(base):
    cls, options = BASES[base]
    ours, plain = ([nn.Parameter(t.clone()) for t in _initial()] for _ in range(2))
    slowmo = SlowMo(_groups(ours), lr=_lr(base, 1), base=base, base_options=options, sync_interval=1,
                    slow_momentum=0.0, slow_lr=1.0)
    reference = cls(_groups(plain), lr=_lr(base, 1), **options)
    for step in range(1, 6):
        for optimizer, params in ((slowmo, ours), (reference, plain)):
            for group in optimizer.param_groups:
                group["lr"] = _lr(base, step)
            for i, p in enumerate(params):
                p.grad = _grad(0, step, i)
            optimizer.step()
    for a, b in zip(ours, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_step_and_sync_read_nothing_on_the_host(monkeypatch):
    reads = count_host_reads(monkeypatch, "optim/slowmo.py")
    params = [nn.Parameter(t.clone()) for t in _initial()]
    slowmo = SlowMo(_groups(params), lr=0.1, base="sgd", sync_interval=2, average_buffers=True)
    for step in range(1, 5):
        for i, p in enumerate(params):
            p.grad = _grad(0, step, i)
        slowmo.step()
    assert reads == []
    # Between syncs the trainer evaluates and exports the replicas' average (train.replicas).
    assert [slowmo.replicas_agree_after(step) for step in range(1, 5)] == [False, True, False, True]


def test_param_groups_are_the_bases_so_the_schedule_reaches_it_also_after_loading():
    params = [nn.Parameter(t.clone()) for t in _initial()]
    slowmo = SlowMo(_groups(params), lr=0.1, base="sgd", sync_interval=2)
    assert slowmo.param_groups is slowmo.base.param_groups
    assert [g["weight_decay"] for g in slowmo.base.param_groups] == [0.01, 0.0]
    for group in slowmo.param_groups:
        group["lr"] = 0.05
    for i, p in enumerate(params):
        p.grad = _grad(0, 1, i)
    before = params[1].detach().clone()
    slowmo.step()
    torch.testing.assert_close(params[1].detach(), before - 0.05 * _grad(0, 1, 1))  # no momentum: SGD's defaults

    other = SlowMo(_groups([nn.Parameter(t.clone()) for t in _initial()]), lr=0.1, base="sgd", sync_interval=2)
    other.load_state_dict(slowmo.state_dict())
    assert other.param_groups is other.base.param_groups and other.param_groups[0]["lr"] == 0.05
    other.param_groups[1]["lr"] = 0.3
    assert other.base.param_groups[1]["lr"] == 0.3
    assert other.state["slowmo"] == {"step": 1}


def test_trainer_hooks_and_zero_grad_work_on_the_wrapper():
    params = [nn.Parameter(t.clone()) for t in _initial()]
    slowmo = SlowMo(_groups(params), lr=0.1, base="lars")
    calls = []
    slowmo.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
    for i, p in enumerate(params):
        p.grad = _grad(0, 1, i)
    slowmo.step()
    slowmo.zero_grad(set_to_none=True)
    assert calls == [slowmo] and all(p.grad is None for p in params)


@pytest.mark.parametrize(("overrides", "start"), [
    ({"base_options": {"momentum": 0.9}}, "optim.base_options.momentum is not an option of base optimizer 'lamb'"),
    ({"base": "adamw", "base_options": {"betas": [0.9, 1.0]}}, "optim.base_options.betas=[0.9, 1.0] must be"),
    ({"base": "sgd", "base_options": {"nesterov": True}}, "optim.base_options.nesterov=True needs momentum > 0"),
    ({"base_options": {"lr": 0.1}}, "optim.base_options.lr=0.1 is SlowMo's own option"),
    ({"base": "slamb"}, "optim.base=slamb must be one of sgd, adamw, apex_adam, apex_lamb, lamb, lars"),
])
def test_base_options_are_checked_at_config_time_naming_the_key(overrides, start):
    options = {"lr": 6e-3, "weight_decay": 0.01, "base": "lamb", "base_options": {}} | overrides
    with pytest.raises(ConfigError) as info:
        check_optimizer_config("slowmo", options)
    assert str(info.value).startswith(start)


def test_composed_configs_check_the_base_options():
    from train.config import ConfigError as TrainConfigError
    from train.config import validate

    cfg = compose(["optim=slowmo", "optim.base=sgd", "optim.lr=0.1", "+optim.base_options.momentum=0.9"])
    validate(cfg)  # the README's command
    assert cfg.optim.base_options == {"momentum": 0.9}
    with pytest.raises(TrainConfigError, match=r"^optim\.base_options\.betas=\[0\.9, 1\.5\] must be"):
        validate(compose(["experiment=slowmo_swin_demo", "+optim.base_options.betas=[0.9,1.5]"]))


def test_built_from_config_with_the_registry():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    optimizer = build_optimizer(model, "slowmo", {"base": "adamw", "base_options": {"betas": [0.8, 0.9]},
                                                  "weight_decay": 0.05, "lr": 1e-3})
    assert isinstance(optimizer.base, torch.optim.AdamW)
    assert optimizer.base.defaults["betas"] == (0.8, 0.9)
    assert [(g["name"], g["weight_decay"]) for g in optimizer.param_groups] == [("decay", 0.05), ("no_decay", 0.0)]
