"""Continuing another run's optimizer state with fresh step counts: phase 2 of NVIDIA's BERT recipe.

NVIDIA's phase 2 loads phase 1's LAMB state (m, v) and sets its step counts to 0, so that the bias corrections
and the LR schedule start over as for a new run. `restart_optimizer` does that for every optimizer of the
registry whose state can continue: it keeps the config's hyper-parameters (a plain `load_state_dict` would
take the saved run's lr, betas, weight_decay from its param groups), loads the saved moments, and zeroes every
step count the optimizers keep:

- `group["step"]` (our LAMB, apex's FusedLAMB and FusedAdam: one count per param group);
- `state[p]["step"]` (torch's AdamW; our LAMB's per-tensor bookkeeping, from which its `load_state_dict`
  rebuilds a missing group count);
- `state[<name>]["step"]`, the optimizer-wide entries of SLAMB (`"slamb"`), SlowMo (`"slowmo"`) and JointSpar
  (`"jointspar"`), and inside SlowMo's and JointSpar's base optimizer the same again. SLAMB's freshness is stored
  relative to its step (`scaled_freshness`), so it is re-expressed for step 0, keeping each row's r.

SlowMo's anchors are positions, not moments: they are set to the weights the new run starts from (the same
weights when the saved run ended on an average), so its first outer step sees only its own displacement; its
slow momentum continues.

The 1-bit family cannot continue: its count places every step in a stage (warm-up, frozen variance with
compressed momentum and per-rank error feedback), and the saved state belongs to the stage it was written in.
"""

from __future__ import annotations

from typing import Any

import torch

from conf.checks import ConfigError
from optim.onebit_adam import OneBitFamily
from optim.slamb import SLAMB
from optim.slowmo import SlowMo

_ONEBIT_REASON = ("keeps a stage-bound state (frozen variance, compression error buffers) that a fresh step count "
                  "would put in the wrong stage")


def cannot_restart(cls: Any) -> str | None:
    """Why optimizer class (or builder) `cls` cannot continue saved state with fresh step counts; None if it can."""
    if isinstance(cls, type) and issubclass(cls, OneBitFamily):
        return _ONEBIT_REASON
    return None


def restart_optimizer(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Load `saved` (another run's `state_dict()`) into `optimizer` with the optimizer's own hyper-parameters and
    every step count at 0: the next `step()` is step 1 for the bias corrections and every schedule."""
    reason = cannot_restart(type(optimizer))
    if reason is not None:
        raise ConfigError(f"{type(optimizer).__name__} {reason}")
    optimizer.load_state_dict(_with_current_hyperparameters(optimizer, saved))
    _zero_steps(optimizer)
    if isinstance(optimizer, SlowMo):
        _anchor_at_the_weights(optimizer)


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


def _zero_steps(optimizer: torch.optim.Optimizer) -> None:
    """Every step count of `optimizer` (and of its base) to 0; see the module docstring for where they are."""
    if isinstance(optimizer, SLAMB):  # before its step changes: r is read relative to it
        optimizer.restart_freshness()
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for entry in optimizer.state.values():
        if "step" in entry:  # new tensors: the loaded ones may still map the checkpoint file
            entry["step"] = torch.zeros_like(entry["step"]) if torch.is_tensor(entry["step"]) else 0
    base = getattr(optimizer, "base", None)
    if base is not None:
        _zero_steps(base)


def _anchor_at_the_weights(optimizer: SlowMo) -> None:
    """SlowMo's anchors (the weights after the last outer step) := the weights now: this run has had no step yet."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if "anchor" in optimizer.state[p]:
                    optimizer.state[p]["anchor"].copy_(p)
