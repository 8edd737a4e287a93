"""Tasks turn a model and a batch into a dict holding `"loss"` plus metrics; they know nothing of optimizers."""

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
from train.tasks.bert_pretraining import bert_pretraining_step, evaluate_bert_pretraining
from train.tasks.image_classification import evaluate_image_classification, image_classification_step
from train.tasks.question_answering import evaluate_squad, question_answering_step

__all__ = [
    "EvalShard",
    "Task",
    "TaskConfig",
    "bert_pretraining_step",
    "check_task_config",
    "evaluate_bert_pretraining",
    "evaluate_image_classification",
    "evaluate_model",
    "evaluate_squad",
    "get_task",
    "image_classification_step",
    "list_tasks",
    "question_answering_step",
    "register_task",
]
