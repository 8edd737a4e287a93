"""Task registry: a task name (`conf/task/<name>.yaml`) -> its step function and optional evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING
from torch import nn

from conf.checks import ConfigError

StepFn = Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
# evaluate(model, eval_data, output_dir) -> metrics; runs on one rank, under no_grad and autocast.
EvaluateFn = Callable[[nn.Module, Any, Path], dict[str, float]]


@dataclass
class TaskConfig:
    """Schema of conf/task/*.yaml."""

    name: str = MISSING  # a registered task (bert_pretraining, question_answering, image_classification)


@dataclass(frozen=True)
class Task:
    name: str
    step: StepFn  # a batch -> {"loss": scalar tensor, other metrics as tensors}
    evaluate: EvaluateFn | None = None  # a whole held-out set -> metrics (accuracy, F1, ...)
    sample_unit: str = "seq"  # what one training sample is, for throughput (seq/s, img/s)


_TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    if task.name in _TASKS:
        raise ValueError(f"task '{task.name}' is registered twice")
    _TASKS[task.name] = task
    return task


def list_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task '{name}'; known tasks: {', '.join(list_tasks())}") from None


def check_task_config(name: str) -> None:
    """Compose-time check of `task.name`."""
    if name not in _TASKS:
        raise ConfigError(f"task.name={name} is not a registered task; known tasks: {', '.join(list_tasks())}")
