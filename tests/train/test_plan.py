"""The run's plan: made once by the launching process, pickled to the workers, built from without a second check."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from pathlib import Path

import pytest
from helpers.config import TINY, compose

from core.errors import ConfigError
from optim import _registry, get_optimizer_spec
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from train.plan import plan_run
from train.run import run
from train.trainer import Trainer


def test_the_plan_pickles_and_a_worker_builds_from_it(tmp_path: Path):
    plan = plan_run(compose([*TINY, "trainer.max_steps=2"]), tmp_path)
    assert plan.model == "bert_pretraining" and plan.optimizer == "lamb"
    assert "name" not in plan.model_options and "name" not in plan.optimizer_options
    crossed = pickle.loads(pickle.dumps(plan))  # what the spawn boundary does to it
    assert crossed == plan
    trainer = Trainer(crossed, Comm())
    assert trainer.max_steps == 2 and trainer.geometry == plan.geometry
    assert trainer.optimizer.defaults["lr"] == plan.optimizer_options["lr"]
    assert trainer.train_step() is not None
    trainer.close()


def test_a_worker_in_a_world_of_another_size_than_planned_fails_in_one_line(tmp_path: Path):
    plan = plan_run(compose(TINY), tmp_path)
    assert plan.geometry.world_size == 1
    with pytest.raises(ConfigError, match=r"planned for 1 rank\(s\) .* process group has 2: start it with 1") as info:
        Trainer(plan, MirrorComm(2))
    assert "\n" not in str(info.value)


# The option checks on the way from `run()` to each optimizer: (registry name, module, the constructor's function).
CHECKS = {
    "lamb": [("lamb", "optim.lamb", "check_lamb_options")],
    "slamb": [("slamb", "optim.slamb.optimizer", "check_slamb_options")],
    "onebit_lamb": [("onebit_lamb", "optim.onebit_lamb", "check_onebit_lamb_options")],
    "adamw": [("adamw", "optim.adamw", "check_adam_hyperparameters")],  # torch's constructor has its own checks
    "jointspar": [("jointspar", "optim.jointspar", "check_jointspar_options"),
                  ("lamb", "optim.lamb", "check_lamb_options")],  # its base, checked inside its own check
    "slowmo": [("slowmo", "optim.slowmo", "check_slowmo_options"), ("lamb", "optim.lamb", "check_lamb_options")],
}


@pytest.mark.parametrize("optimizer", CHECKS)
def test_a_config_value_is_checked_once_from_run_to_the_optimizer(optimizer, monkeypatch, tmp_path: Path):
    """The launching process checks the options; the worker's `build_optimizer` and constructor do not again."""
    calls: dict[str, int] = {}
    monkeypatch.setattr(_registry.OPTIMIZERS, "_entries", dict(_registry.OPTIMIZERS.entries))  # restored after
    for name, module, function in CHECKS[optimizer]:
        check = getattr(importlib.import_module(module), function)

        def counted(options, name=name, check=check):
            calls[name] = calls.get(name, 0) + 1
            check(options)

        spec = dataclasses.replace(get_optimizer_spec(name), check=counted)
        monkeypatch.setitem(_registry.OPTIMIZERS.entries, name, spec)
        monkeypatch.setattr(importlib.import_module(module), function, counted)
    run(compose([*TINY, f"optim={optimizer}", "trainer.max_steps=1", "trainer.nproc_per_node=1"]), tmp_path)
    assert calls == {name: 1 for name, _, _ in CHECKS[optimizer]}
