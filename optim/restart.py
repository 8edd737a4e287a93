"""Continuing another run's optimizer state with fresh step counts: phase 2 of NVIDIA's BERT recipe.

NVIDIA's phase 2 loads phase 1's LAMB state (m, v) and sets its step counts to 0, so that the bias corrections
and the LR schedule start over as for a new run. `restart_optimizer` is that, for any optimizer whose state holds
nothing else bound to its step count: it keeps the config's hyper-parameters (a plain `load_state_dict` would
take the saved run's lr, betas, weight_decay from its param groups), loads the saved moments, and zeroes every
step count the optimizers keep:

- `group["step"]` (our LAMB, apex's FusedLAMB and FusedAdam: one count per param group);
- `state[p]["step"]` (torch's AdamW; our LAMB's per-tensor bookkeeping, from which its `load_state_dict`
  rebuilds a missing group count);
- `state[<name>]["step"]`, the optimizer-wide entries of SLAMB (`"slamb"`), SlowMo (`"slowmo"`) and JointSpar
  (`"jointspar"`), and inside SlowMo's and JointSpar's base optimizer the same again.

It is every registry record's `restart` unless the optimizer has its own (`OptimSpec.restart`): SLAMB re-expresses
its step-relative freshness between the two halves, SlowMo moves its anchors to the new run's weights.
"""

from __future__ import annotations

from typing import Any

import torch


def restart_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load `saved` (another run's `state_dict()`) into `optimizer` with the optimizer's own hyper-parameters and
    every step count at 0: the next `step()` is step 1 for the bias corrections and every schedule."""
    load_with_current_hyperparameters(optimizer, saved)
    zero_step_counts(optimizer)


def load_with_current_hyperparameters(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(saved)`, keeping `optimizer`'s param-group values (and its base's), not the
    saved run's."""
    optimizer.load_state_dict(_with_current_hyperparameters(optimizer, saved))


def _with_current_hyperparameters(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` whose param groups (and its base optimizer's) carry `optimizer`'s values, not the saved run's."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer state has {len(saved['param_groups'])} param groups, this optimizer "
                         f"{len(optimizer.param_groups)}: the models or weight-decay groups differ")
    groups = [{**{k: v for k, v in current.items() if k != "params"}, "params": old["params"]}
              for current, old in zip(optimizer.param_groups, saved["param_groups"], strict=True)]
    restarted = {**saved, "param_groups": groups}
    if "base" in saved:  # SlowMo, JointSpar: the base's groups are the ones the wrapper keeps
        restarted["base"] = _with_current_hyperparameters(optimizer.base, saved["base"])
    return restarted


def zero_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Every step count of `optimizer` (and of its base) to 0; see the module docstring for where they are."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for entry in optimizer.state.values():
        if "step" in entry:  # new tensors: the loaded ones may still map the checkpoint file
            entry["step"] = torch.zeros_like(entry["step"]) if torch.is_tensor(entry["step"]) else 0
    base = getattr(optimizer, "base", None)
    if base is not None:
        zero_step_counts(base)
