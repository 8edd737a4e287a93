"""The start-up memory estimate: each optimizer's bytes per parameter against what it really holds, the
estimate's arithmetic, the banner line and its warning, and the line in a real run's log."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.config import TINY, compose, optim_preset
from torch import nn
from transformers import BertForPreTraining

from optim import build_optimizer, get_optimizer_spec
from optim.apex import APEX_OPTIMIZERS, runnable_optimizers
from optim.comm import Comm
from optim.memory import GIB, bytes_per_param, estimate_memory, memory_lines, persistent_bytes, state_bytes
from train import trainer as trainer_module
from train.run import run
from train.run_dir import RunDir

STEPS = 4  # with freeze_step=2 the 1-bit optimizers take compressed steps: their work buffers exist


class _SizedComm(Comm):
    """One process whose optimizers lay out their buffers for `world_size` ranks; collectives are never called
    (`distributed` is False), so only the allocation, which is what is measured here, depends on the size."""

    def __init__(self, world_size: int) -> None:
        super().__init__(None)
        self.world_size = world_size

    @property
    def distributed(self) -> bool:
        return False


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256)).to(device)


def _stepped(name: str, kwargs: dict, world_size: int, device: str = "cpu") -> tuple[torch.optim.Optimizer, int]:
    """Optimizer `name` over `_model()` after `STEPS` steps, and the model's parameter count."""
    model = _model(device)
    optimizer = build_optimizer(model, name, {"lr": 1e-3, **kwargs}, comm=_SizedComm(world_size))
    for step in range(STEPS):
        if hasattr(optimizer, "begin_step"):  # JointSpar draws its layers
            optimizer.begin_step()
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer, sum(p.numel() for p in model.parameters())


def _bounded_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Work buffers bounded by a constant, which the per-parameter estimate leaves out: 1-bit LAMB's work piece,
    SLAMB's chunk scratch."""
    scratch = getattr(optimizer, "_scratch", None)
    if scratch is not None:
        return scratch.untyped_storage().nbytes()
    if hasattr(optimizer, "memory_bytes"):
        return optimizer.memory_bytes()["scratch"]
    return 0


CASES = [  # (registry name, config kwargs, world size, bytes per parameter expected)
    ("adamw", {}, 1, 8),
    ("adamw", {"amsgrad": True}, 1, 12),
    ("lamb", {}, 1, 8),
    ("lars", {}, 1, 4),
    ("lars", {"momentum": 0.0}, 1, 0),
    ("onebit_adam", {"freeze_step": 2}, 1, 21),  # m, v, denominator, errors 4 + 4/1, zero-variance mask
    ("onebit_adam", {"freeze_step": 2}, 4, 18),
    ("onebit_adam", {"freeze_step": 2, "mask_zero_variance": False}, 4, 17),
    ("onebit_lamb", {"freeze_step": 2}, 1, 25),  # and the fresh variance
    ("onebit_lamb", {"freeze_step": 2}, 4, 22),
    ("zero_one_adam", {"var_freeze_step": 2}, 4, 22),  # and the sync anchor
    ("slamb", {}, 4, 8.125),  # fp16 freshness, one per row of 16 coordinates
    ("slamb", {"freshness_dtype": "fp32"}, 1, 8.25),
    ("slamb_v2_official", {"freshness_dtype": "fp32"}, 4, 8.25),
    ("slamb", {"mask": "bernoulli", "freshness_dtype": "fp32"}, 4, 12),  # rows of one coordinate
    ("slowmo", {"base": "lamb"}, 4, 16),  # anchor and slow momentum on top of LAMB's m, v
    ("slowmo", {"base": "sgd", "base_options": {"momentum": 0.9}}, 4, 12),
    ("slowmo", {"base": "sgd"}, 4, 8),
    ("jointspar", {"base": "lamb", "sample_ratio": 1.0}, 4, 8),
    ("jointspar", {"base": "lars", "sample_ratio": 1.0}, 4, 4),
]


@pytest.mark.parametrize(("name", "kwargs", "world_size", "expected"), CASES,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[1].values()))}-w{c[2]}" for c in CASES])
def test_bytes_per_param_matches_what_the_optimizer_holds(name, kwargs, world_size, expected):
    """Distinct storages of every tensor the optimizer holds (state, error buffers, cached denominators and masks),
    bounded work pieces left out, agree with its spec's number within 0.1 % (the rest: O(1) step counters and
    per-tensor scalars, the 1-bit buckets' padding)."""
    optimizer, numel = _stepped(name, kwargs, world_size)
    per_param = bytes_per_param(get_optimizer_spec(name), kwargs, world_size)
    assert per_param == expected
    assert persistent_bytes(optimizer) - _bounded_bytes(optimizer) == pytest.approx(per_param * numel, rel=1e-3)


def test_state_bytes_counts_the_state_alone_and_persistent_bytes_adds_the_work_buffers():
    """1-bit Adam past its warm-up: the state holds m and v (8 bytes); the error buffers, the denominator and the
    mask live beside it (4 + 4 + 4 + 1 at one rank)."""
    optimizer, numel = _stepped("onebit_adam", {"freeze_step": 2}, 1)
    assert state_bytes(optimizer) == 8 * numel
    assert persistent_bytes(optimizer) == 21 * numel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", APEX_OPTIMIZERS)
def test_apex_bytes_per_param_matches_what_it_holds(name):
    pytest.importorskip("apex.optimizers")
    optimizer, numel = _stepped(name, {}, 1, device="cuda")
    assert persistent_bytes(optimizer) == pytest.approx(bytes_per_param(get_optimizer_spec(name), {}, 1) * numel,
                                                        rel=1e-3)


MEASURED_ABOVE = {case[0] for case in CASES} | set(APEX_OPTIMIZERS)  # apex's on a GPU


@pytest.mark.parametrize("name", [name for name in runnable_optimizers() if name not in MEASURED_ABOVE
                                  and get_optimizer_spec(name).state_bytes_per_param is not None])
def test_bytes_per_param_of_any_other_optimizer_matches_its_preset(name):
    """An optimizer that declares its number (`state_bytes_per_param` is optional: without it the banner says
    "unknown") and is not measured above is held to it with its preset's options, past any warm-up."""
    spec = get_optimizer_spec(name)
    kwargs = optim_preset(name) | ({spec.warmup_option: 2} if spec.warmup_option else {})
    optimizer, numel = _stepped(name, kwargs, 4)
    per_param = bytes_per_param(spec, kwargs, 4)
    assert persistent_bytes(optimizer) - _bounded_bytes(optimizer) == pytest.approx(per_param * numel, rel=1e-3)


def test_estimate_counts_weights_trainable_gradients_and_state():
    """Frozen parameters have weights but no gradient and no optimizer state; bf16 weights count 2 bytes."""
    model = nn.Sequential(nn.Linear(100, 10), nn.Linear(10, 10))  # 1010 + 110 parameters
    model[0].weight.requires_grad_(False)  # 1000 frozen
    model[1].to(torch.bfloat16)
    estimate = estimate_memory(model, get_optimizer_spec("lamb"), {}, world_size=2)
    assert estimate == {"weights": 1010 * 4 + 110 * 2, "gradients": 10 * 4 + 110 * 2,
                        "optimizer": 8 * 120, "total": 1010 * 4 + 110 * 2 + 10 * 4 + 110 * 2 + 8 * 120}


def test_o2_half_copy_adds_its_weights_and_their_gradients():
    model = nn.Linear(1000, 100)  # 100100 fp32 parameters, masters of a bf16 copy of 2 bytes each
    plain = estimate_memory(model, get_optimizer_spec("lamb"), {}, world_size=1)
    o2 = estimate_memory(model, get_optimizer_spec("lamb"), {}, world_size=1, half_copy_bytes=2 * 100100)
    assert o2 == {**plain, "weights": 6 * 100100, "gradients": 6 * 100100, "total": plain["total"] + 4 * 100100}
    assert o2["total"] == 20 * 100100  # LAMB under O2: 20 bytes per parameter (autocast: 16)


def test_estimate_takes_the_config_kwargs_and_the_world_size():
    model = nn.Linear(1000, 100)  # 100100 parameters
    estimate = estimate_memory(model, get_optimizer_spec("onebit_lamb"), {"mask_zero_variance": False}, 4)
    assert estimate["optimizer"] == 21 * 100100  # 4 buffers, errors 4 + 1


def test_banner_line_against_the_device_memory():
    estimate = {"weights": int(1.25 * GIB), "gradients": int(1.25 * GIB), "optimizer": int(2.5 * GIB),
                "total": 5 * GIB}
    assert memory_lines(estimate, 80 * GIB) == [
        "memory per rank (persistent): weights 1.25 GiB + gradients 1.25 GiB + optimizer state 2.50 GiB "
        "= 5.00 GiB of 80.0 GiB (activations extra)"]


def test_banner_warns_above_ninety_percent_of_the_device():
    estimate = {"weights": 8 * GIB, "gradients": 8 * GIB, "optimizer": 14 * GIB, "total": 30 * GIB}
    line, warning = memory_lines(estimate, 32 * GIB)
    assert line.endswith("= 30.00 GiB of 32.0 GiB (activations extra)")
    assert warning.startswith("warning: the persistent tensors alone take 94% of the device's 32.0 GiB")
    assert len(memory_lines(estimate, 34 * GIB)) == 1  # 88 %: no warning


def test_banner_without_a_device_total_or_an_optimizer_number():
    estimate = {"weights": GIB, "gradients": GIB, "total": 2 * GIB}
    assert memory_lines(estimate, None) == [
        "memory per rank (persistent): weights 1.00 GiB + gradients 1.00 GiB + optimizer state unknown "
        "= 2.00 GiB (activations extra)"]


_LINE = re.compile(r"memory per rank \(persistent\): weights (\S+) GiB \+ gradients (\S+) GiB \+ optimizer state "
                   r"(\S+) GiB = (\S+) GiB(?: of (\S+) GiB)? \(activations extra\)")


def _memory_line(run_dir) -> re.Match:
    matches = [m for m in map(_LINE.search, RunDir(run_dir).log_file.read_text().splitlines()) if m]
    assert len(matches) == 1
    return matches[0]


def test_a_run_logs_the_estimate_at_start_up(tmp_path, monkeypatch):
    """Tiny BERT with optim=slamb_v2_official on the CPU: the estimate is of the trainer's model with the config's
    options (its YAML's fp32 freshness: 12 bytes per parameter, where the class default would give 10), and its
    line is in the run's log, with no device total."""
    estimates = []
    monkeypatch.setattr(trainer_module, "memory_lines",
                        lambda estimate, total: estimates.append(estimate) or memory_lines(estimate, total))
    run(compose([*TINY, "optim=slamb_v2_official", "trainer.max_steps=1"]), tmp_path)
    n = sum(p.numel() for p in BertForPreTraining.from_pretrained(tmp_path / "hf_model").parameters())
    assert estimates == [{"weights": 4 * n, "gradients": 4 * n, "optimizer": 12 * n, "total": 20 * n}]
    line = _memory_line(tmp_path)
    assert line.group(0) == memory_lines(estimates[0], None)[0]
    assert line.group(5) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_states_the_device_memory(tmp_path):
    run(compose([*TINY, "optim=lamb", "trainer.max_steps=1", "trainer.device=cuda"]), tmp_path)
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    assert float(_memory_line(tmp_path).group(5)) == pytest.approx(total, abs=0.05)
