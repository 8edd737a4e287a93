"""Optimizers, their registry and parameter groups, and learning-rate schedules.

Importing the package registers every optimizer: it imports each public module of `optim/` (packages included),
and an optimizer's module registers its own spec, so a new optimizer is not named here. Every module here is
imported by some optimizer anyway; optional dependencies (NVIDIA apex) are imported late, inside their builders.
"""

import importlib
import pkgutil

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


def _import_public_modules() -> None:
    """Import `optim.<name>` for every public module and package here, so that each registers its optimizers.
    In name order: an entry that names others (SlowMo's `base`) looks them up when its options are checked."""
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_import_public_modules()

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
