"""`torch.optim.AdamW`, registered as `adamw`: the decoupled-weight-decay Adam baseline."""

from __future__ import annotations

import torch

from optim._math import check_adam_hyperparameters
from optim._registry import OptimSpec, register_optimizer

register_optimizer(OptimSpec(
    "adamw", torch.optim.AdamW, "ddp", check=check_adam_hyperparameters,  # torch's constructor checks them too
    state_bytes_per_param=lambda options, world_size: 12.0 if options["amsgrad"] else 8.0,  # m, v (, max v)
    description="torch.optim.AdamW (Loshchilov & Hutter, arXiv 1711.05101): Adam with decoupled weight decay",
))
