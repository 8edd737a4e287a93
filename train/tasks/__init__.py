"""Tasks turn a model and a batch into a dict holding `"loss"` plus metrics; they know nothing of optimizers.

A task's module registers it (`register_task`), and the registry imports every public module here on its first
lookup, so a new task is named nowhere else.
"""

from train.tasks._registry import (
    EvalShard,
    Task,
    TaskConfig,
    check_task_config,
    evaluate_model,
    get_task,
    list_tasks,
    register_task,
)

__all__ = [
    "EvalShard",
    "Task",
    "TaskConfig",
    "check_task_config",
    "evaluate_model",
    "get_task",
    "list_tasks",
    "register_task",
]
