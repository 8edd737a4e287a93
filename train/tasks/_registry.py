"""Task registry: a task name (`conf/task/<name>.yaml`) -> its step function."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Task = Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
_TASKS: dict[str, Task] = {}


def register_task(name: str) -> Callable[[Task], Task]:
    def wrap(fn: Task) -> Task:
        if name in _TASKS:
            raise ValueError(f"task '{name}' is registered twice")
        _TASKS[name] = fn
        return fn

    return wrap


def list_tasks() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task '{name}'; known tasks: {', '.join(list_tasks())}") from None
