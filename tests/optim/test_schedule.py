"""LR schedules: NVIDIA's poly warm-up values, the cosine schedule, and errors for impossible settings."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
from helpers.config import REPO
from omegaconf import OmegaConf

from optim import build_lr_schedule
from optim.schedule import constant, linear_warmup_cosine, poly_warmup

CONF = REPO / "conf"


def _nvidia_poly(last_epoch: int, total_steps: int, warmup: float, degree: float = 0.5) -> float:
    """`PolyWarmUpScheduler.get_lr` of NVIDIA DeepLearningExamples BERT `schedulers.py` (base_lr 1)."""
    progress = last_epoch / total_steps
    return progress / warmup if progress < warmup else (1.0 - progress) ** degree


@pytest.mark.parametrize(("total", "warmup"), [(7038, 0.2843), (1563, 0.128)], ids=["phase1", "phase2"])
def test_poly_warmup_matches_nvidia_at_every_step(total, warmup):
    schedule = build_lr_schedule("poly_warmup", total_steps=total, warmup_fraction=warmup, degree=0.5)
    for step in range(1, total + 1):
        assert schedule(step) == pytest.approx(_nvidia_poly(step, total, warmup), abs=1e-12)


def test_poly_warmup_phase1_landmarks():
    schedule = build_lr_schedule("poly_warmup", total_steps=7038, warmup_fraction=0.2843)
    # NVIDIA's first update runs at last_epoch = 1 (its optimizer's step 0, plus 1).
    assert schedule(1) == pytest.approx(1 / 7038 / 0.2843)
    values = [schedule(step) for step in range(1, 7039)]
    peak = max(range(len(values)), key=values.__getitem__) + 1
    assert peak == 2000 and values[peak - 1] == pytest.approx(2000 / 7038 / 0.2843)  # 0.9995
    # The decay is of (1 - progress), so the LR drops at the end of warm-up, as in NVIDIA's runs.
    assert schedule(2001) == pytest.approx(math.sqrt(1 - 2001 / 7038))  # 0.846
    assert all(a < b for a, b in pairwise(values[:2000]))
    assert all(a > b for a, b in pairwise(values[2000:]))
    assert schedule(7038) == 0.0
    assert schedule(7100) == 0.0  # past the end: floored at 0 (NVIDIA's formula gives NaN there)


def test_poly_warmup_edge_fractions():
    assert poly_warmup(1, 10, warmup_fraction=0.0) == pytest.approx(math.sqrt(0.9))  # no warm-up
    assert poly_warmup(5, 10, warmup_fraction=1.0) == pytest.approx(0.5)  # warm-up only
    assert poly_warmup(5, 10, warmup_fraction=0.0, degree=1.0) == pytest.approx(0.5)


def test_linear_warmup_cosine():
    schedule = build_lr_schedule("linear_warmup_cosine", total_steps=110, warmup_steps=10, min_ratio=0.1)
    assert schedule(1) == pytest.approx(0.1)
    assert schedule(10) == pytest.approx(1.0)
    assert schedule(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert schedule(110) == pytest.approx(0.1)
    assert schedule(500) == pytest.approx(0.1)
    values = [schedule(step) for step in range(10, 111)]
    assert all(a >= b for a, b in pairwise(values))
    assert linear_warmup_cosine(5, total_steps=10, warmup_steps=0) == pytest.approx(0.5)
    assert linear_warmup_cosine(10, total_steps=10, warmup_steps=10, min_ratio=0.2) == pytest.approx(1.0)
    assert linear_warmup_cosine(11, total_steps=10, warmup_steps=10, min_ratio=0.2) == pytest.approx(0.2)


def test_constant():
    schedule = build_lr_schedule("constant", total_steps=100)
    assert schedule(1) == schedule(10_000) == constant(7) == 1.0


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("poly_warmup", dict(total_steps=100, warmup_fraction=1.5), "warmup_fraction=1.5"),
        ("poly_warmup", dict(total_steps=100, warmup_fraction=-0.1), "warmup_fraction=-0.1"),
        ("poly_warmup", dict(total_steps=0, warmup_fraction=0.1), "total_steps=0"),
        ("poly_warmup", dict(total_steps=100, warmup_fraction=0.1, degree=-1.0), "degree=-1.0"),
        ("poly_warmup", dict(total_steps=100), "needs argument 'warmup_fraction'"),
        ("poly_warmup", dict(total_steps=100, warmup_fraction=0.1, warmup=5), "'warmup' is not an argument"),
        ("linear_warmup_cosine", dict(total_steps=100, warmup_steps=200), "warmup_steps=200"),
        ("linear_warmup_cosine", dict(total_steps=100, warmup_steps=10, min_ratio=2.0), "min_ratio=2.0"),
        ("linear_warmup_cosine", dict(total_steps=-5, warmup_steps=0), "total_steps=-5"),
        ("cosine", dict(total_steps=100),
         "known schedules: constant, linear_warmup_cosine, linear_warmup_linear_decay, poly_warmup"),
    ],
)
def test_impossible_settings_raise_naming_the_value(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_lr_schedule(name, **kwargs)


@pytest.mark.parametrize("path", sorted((CONF / "schedule").glob("*.yaml")), ids=lambda p: p.stem)
def test_schedule_configs_build(path):
    cfg = OmegaConf.load(path)
    schedule = build_lr_schedule(cfg.name, total_steps=1000, **cfg.get("kwargs", {}))
    assert 0.0 <= schedule(1) <= 1.0


def test_linear_warmup_linear_decay_matches_bert_finetuning():
    from optim.schedule import linear_warmup_linear_decay

    total = 1000
    assert linear_warmup_linear_decay(50, total, 0.1) == pytest.approx(0.5)
    assert linear_warmup_linear_decay(100, total, 0.1) == pytest.approx(1.0)  # continuous at the peak
    assert linear_warmup_linear_decay(550, total, 0.1) == pytest.approx(0.5)
    assert linear_warmup_linear_decay(total, total, 0.1) == 0.0
    with pytest.raises(ValueError, match=r"warmup_fraction=1\.0"):
        linear_warmup_linear_decay(1, total, 1.0)
