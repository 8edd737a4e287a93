"""Optimizers, their registry and parameter groups, and learning-rate schedules.

Importing the package registers every optimizer (each module registers its own spec).
"""

from optim import adamw, apex  # noqa: F401  (register `adamw`; `apex_lamb`, `apex_adam`: NVIDIA apex's, if installed)
from optim._registry import (
    OptimSpec,
    build_optimizer,
    check_optimizer_config,
    get_optimizer_spec,
    list_optimizers,
    register_optimizer,
)
from optim.jointspar import JointSpar  # registers `jointspar`
from optim.lamb import LAMB  # registers `lamb`
from optim.lars import LARS  # registers `lars`
from optim.onebit_adam import OneBitAdam  # registers `onebit_adam`
from optim.onebit_lamb import OneBitLAMB  # registers `onebit_lamb`
from optim.param_groups import param_groups_weight_decay
from optim.schedule import build_lr_schedule
from optim.slamb import SLAMB  # registers `slamb` and `slamb_v2_official`
from optim.slowmo import SlowMo  # registers `slowmo` (after the bases it may name)
from optim.zero_one_adam import ZeroOneAdam  # registers `zero_one_adam`

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
