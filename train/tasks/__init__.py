"""Tasks turn a model and a batch into a dict holding `"loss"` plus metrics; they know nothing of optimizers."""

from train.tasks._registry import Task, get_task, list_tasks, register_task
from train.tasks.bert_pretraining import bert_pretraining_step

__all__ = ["Task", "bert_pretraining_step", "get_task", "list_tasks", "register_task"]
