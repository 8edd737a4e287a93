"""Task registry: a task name (`conf/task/<name>.yaml`) -> its step function and optional evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import MISSING
from torch import nn

from core.registry import Registry
from train.run_dir import RunDir

StepFn = Callable[[nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class EvalShard:
    """One rank's share of an evaluation: every `world_size`-th held-out batch from its `rank` on, and the pooling
    of every rank's per-batch results back into batch order, so that the metrics are those of one rank
    evaluating every batch, to the bit (sums are taken in the same order)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None  # the process group the ranks pool over (None: the default group)

    def batches(self, num_samples: int, batch_size: int) -> list[list[int]]:
        """This rank's batches as sample indices: batch i holds samples [i * batch_size, (i + 1) * batch_size)."""
        starts = range(self.rank * batch_size, num_samples, self.world_size * batch_size)
        return [list(range(start, min(start + batch_size, num_samples))) for start in starts]

    def pool(self, mine: list[Any]) -> list[Any]:
        """Every rank's per-batch results (picklable, small: sums, or logits on the host), in batch order."""
        if self.world_size == 1:
            return mine
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine, group=self.group)
        total = sum(len(part) for part in parts)
        return [parts[i % self.world_size][i // self.world_size] for i in range(total)]


ONE_RANK = EvalShard()  # a rank evaluating every batch alone

# evaluate(model, eval_data, run_dir, shard) -> metrics; every rank of the shard calls it (under no_grad and
# autocast) and rank 0's metrics are logged; files it writes (predictions) are written by rank 0.
EvaluateFn = Callable[[nn.Module, Any, RunDir, EvalShard], dict[str, float]]


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


# Filled by the task modules of `train/tasks/`, which it imports on its first lookup.
TASKS: Registry[Task] = Registry("task", "task.name", "train.tasks")


def register_task(task: Task) -> Task:
    return TASKS.register(task.name, task)


def list_tasks() -> list[str]:
    return TASKS.names()


def get_task(name: str) -> Task:
    """The task `task.name` selects; an unknown name is a ConfigError listing the known ones."""
    return TASKS.get(name)


def evaluate_model(task: Task, model: nn.Module, eval_data: Any, run_dir: RunDir, shard: EvalShard, precision: str,
                   device: torch.device) -> dict[str, float]:
    """`task.evaluate` in eval mode, without gradients, under the run's autocast: the one way the trainer and
    `python -m train.evaluate` evaluate, so their metrics agree."""
    from train.precision import autocast

    was_training = model.training
    model.eval()
    with torch.no_grad(), autocast(precision, device):
        results = task.evaluate(model, eval_data, run_dir, shard)
    model.train(was_training)
    return results


def check_task_config(name: str) -> None:
    """Compose-time check of `task.name`."""
    TASKS.get(name)
