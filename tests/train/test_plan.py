"""The run's plan: made once by the launching process, pickled to the workers, built from without a second check."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from pathlib import Path

import pytest
from helpers.config import TINY, compose

from core.errors import ConfigError
from optim import _registry, build_lr_schedule, get_optimizer_spec
from optim.comm import Comm
from optim.mirror_comm import MirrorComm
from optim.schedule import ScheduleConfig
from train.checkpoint import RunDirectoryError
from train.config import TrainerConfig
from train.metrics import LoggerConfig
from train.plan import plan_run
from train.precision import PrecisionConfig
from train.run import run
from train.tasks import TaskConfig
from train.trainer import Trainer


def test_the_plan_pickles_and_a_worker_builds_from_it(tmp_path: Path):
    plan = plan_run(compose([*TINY, "trainer.max_steps=2"]), tmp_path)
    assert plan.model.name == "bert_pretraining" and plan.optimizer.name == "lamb"
    assert "name" not in plan.model.options and "name" not in plan.optimizer.options
    crossed = pickle.loads(pickle.dumps(plan))  # what the spawn boundary does to it
    assert crossed == plan
    trainer = Trainer(crossed, Comm())
    assert trainer.max_steps == 2 and trainer.geometry == plan.geometry
    assert trainer.optimizer.defaults["lr"] == plan.optimizer.lr
    assert trainer.train_step() is not None
    trainer.close()


def test_a_worker_builds_from_the_typed_sections_not_the_record(tmp_path: Path):
    """`config` is the record alone: a worker given a record that says otherwise still trains as planned."""
    plan = plan_run(compose([*TINY, "trainer.max_steps=2", "optim.lr=0.002"]), tmp_path)
    assert isinstance(plan.trainer, TrainerConfig) and isinstance(plan.precision, PrecisionConfig)
    assert isinstance(plan.schedule, ScheduleConfig) and isinstance(plan.logger, LoggerConfig)
    assert isinstance(plan.task, TaskConfig) and plan.data.name == "demo"
    assert plan.optimizer.lr == 0.002 and "lr" in plan.optimizer.options  # one copy: the options' own
    record = {**plan.config, "trainer": {**plan.config["trainer"], "max_steps": 9, "seed": 7},
              "optim": {**plan.config["optim"], "lr": 1.0}, "schedule": {"name": "constant", "kwargs": {}}}
    trainer = Trainer(dataclasses.replace(plan, config=record), Comm())
    assert trainer.max_steps == 2 and trainer.peak_lr == 0.002
    planned_lr = 0.002 * build_lr_schedule(plan.schedule.name, total_steps=2, **plan.schedule.kwargs)(1)
    assert planned_lr < 0.002  # poly_warmup has decayed at step 1 of 2: not the record's constant schedule
    metrics = trainer.train_step()
    assert metrics["lr"] == pytest.approx(planned_lr)
    assert all(group["lr"] == metrics["lr"] for group in trainer.optimizer.param_groups)
    trainer.close()


def test_planning_checks_the_run_directory(tmp_path: Path):
    """The launcher is plan -> record -> launch: a directory whose checkpoints the run must not continue is refused
    by planning itself."""
    run(compose([*TINY, "trainer.max_steps=2"]), tmp_path)
    with pytest.raises(RunDirectoryError, match=r"trainer\.resume=false"):
        plan_run(compose([*TINY, "trainer.max_steps=4", "trainer.resume=false"]), tmp_path)
    with pytest.raises(RunDirectoryError, match=r"trained with trainer\.seed=42"):
        plan_run(compose([*TINY, "trainer.max_steps=4", "trainer.seed=1"]), tmp_path)
    assert plan_run(compose([*TINY, "trainer.max_steps=4"]), tmp_path).trainer.max_steps == 4


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
