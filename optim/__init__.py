"""Optimizers, their registry and parameter groups, and learning-rate schedules.

An optimizer's module registers its own spec, and the registry imports every public module of `optim/` (packages
included) on its first lookup, so a new optimizer is named nowhere else. Optional dependencies (NVIDIA apex) are
imported late, inside their builders.
"""

from optim._registry import (
    OptimSpec,
    build_optimizer,
    check_optimizer_config,
    get_optimizer_spec,
    list_optimizers,
    register_optimizer,
)
from optim.jointspar import JointSpar
from optim.lamb import LAMB
from optim.lars import LARS
from optim.onebit_adam import OneBitAdam
from optim.onebit_lamb import OneBitLAMB
from optim.param_groups import param_groups_weight_decay
from optim.schedule import build_lr_schedule
from optim.slamb import SLAMB
from optim.slowmo import SlowMo
from optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "LAMB",
    "LARS",
    "SLAMB",
    "JointSpar",
    "OneBitAdam",
    "OneBitLAMB",
    "OptimSpec",
    "SlowMo",
    "ZeroOneAdam",
    "build_lr_schedule",
    "build_optimizer",
    "check_optimizer_config",
    "get_optimizer_spec",
    "list_optimizers",
    "param_groups_weight_decay",
    "register_optimizer",
]
