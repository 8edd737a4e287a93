"""Optimizers, their registry and parameter groups, and learning-rate schedules.

Importing the package registers every optimizer (each module registers its own spec).
"""

from optim import adamw  # noqa: F401  (registers `adamw`)
from optim._registry import (
    OptimSpec,
    build_optimizer,
    get_optimizer_spec,
    list_optimizers,
    register_optimizer,
)
from optim.lamb import LAMB  # registers `lamb`
from optim.param_groups import param_groups_weight_decay
from optim.schedule import build_lr_schedule

__all__ = [
    "LAMB",
    "OptimSpec",
    "build_lr_schedule",
    "build_optimizer",
    "get_optimizer_spec",
    "list_optimizers",
    "param_groups_weight_decay",
    "register_optimizer",
]
