"""Base optimizers for the wrappers that run one inside (SlowMo, JointSpar): naming, checking and building them.

A wrapper takes `base` (a name) and `base_options` (the base's other keyword arguments) from the config. `lr` and
`weight_decay` are the wrapper's own options, passed down to the base, so the trainer's schedule and the
weight-decay groups work as for any optimizer. A bad base option is reported as `base_options.<key>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from core.options import InvalidOption, check_choice, check_kwargs, check_non_negative, require
from optim._registry import OptimSpec, _options, _plain, get_optimizer_spec
from optim.option_checks import check_flags

FROM_WRAPPER = ("lr", "weight_decay")  # what the base takes from the wrapper's param groups, never from base_options


def _check_sgd_options(options: dict[str, Any]) -> None:
    """The checks of `torch.optim.SGD`'s options that a config can get wrong (torch checks the rest itself)."""
    check_non_negative("lr", options["lr"])
    momentum = options["momentum"]
    require(isinstance(momentum, int | float) and 0.0 <= momentum < 1.0, "momentum", momentum, "must be in [0, 1)")
    check_non_negative("weight_decay", options["weight_decay"])
    check_flags(options, "nesterov")
    require(not options["nesterov"] or (momentum > 0 and options["dampening"] == 0), "nesterov",
            options["nesterov"], "needs momentum > 0 and dampening 0")


# Plain SGD is a base only: as an optimizer of its own the project has LARS (and SGD is LARS's inner loop).
SGD = OptimSpec("sgd", torch.optim.SGD, "ddp", check=_check_sgd_options,
                state_bytes_per_param=lambda options, world_size: 4.0 if options["momentum"] else 0.0,
                description="torch.optim.SGD (momentum, Nesterov): the base of Local SGD and of JointSpar")


def base_spec(name: str) -> OptimSpec:
    """The spec of base `name`: `sgd`, or a registered optimizer."""
    return SGD if name == "sgd" else get_optimizer_spec(name)


def check_base_options(options: Mapping[str, Any], allowed: Sequence[str], wrapper: str) -> None:
    """Check `options["base"]` against `allowed` and `options["base_options"]` with the base's own check, where
    the base gets the wrapper's `lr` and `weight_decay`. Raises `InvalidOption` naming `base_options.<key>`."""
    check_choice("base", options["base"], allowed)
    base_options = options["base_options"] if options["base_options"] is not None else {}
    require(isinstance(base_options, Mapping), "base_options", base_options, "must be a mapping of the base's options")
    for key in FROM_WRAPPER:
        require(key not in base_options, f"base_options.{key}", base_options.get(key),
                f"is {wrapper}'s own option: set {key} beside base, not in base_options")
    spec = base_spec(options["base"])
    try:
        check_kwargs(spec.cls, base_options, owner=f"base optimizer '{spec.name}'",
                     reserved=("params", "comm", *FROM_WRAPPER))
        spec.check({**_options(spec.cls), **spec.defaults, **_plain(base_options),
                    "lr": options["lr"], "weight_decay": options["weight_decay"]})
    except InvalidOption as err:
        key = err.key if err.key in FROM_WRAPPER else f"base_options.{err.key}"
        raise InvalidOption(key, err.why, err.value) from None


def build_base(
    name: str, params: Any, lr: float, weight_decay: float, base_options: Mapping[str, Any] | None
) -> torch.optim.Optimizer:
    """Base `name` over `params` (tensors or param groups), with the entry's defaults under `base_options`."""
    spec = base_spec(name)
    return spec.cls(params, lr=lr, weight_decay=weight_decay, **{**spec.defaults, **_plain(base_options or {})})


class BaseWrapper(torch.optim.Optimizer):
    """An optimizer that runs a base optimizer inside (SlowMo, JointSpar).

    Both share one list of param groups, the base's, so the trainer's schedule, which writes `lr` into
    `param_groups`, reaches the base; the wrapper's `state_dict()` nests the base's under ``"base"``.
    """

    def _adopt(self, base: torch.optim.Optimizer) -> None:
        """Take `base`'s param groups as this optimizer's (call from `__init__` instead of `super().__init__`)."""
        self.base = base
        # Optimizer's own set-up (step hooks, `state`) over the base's groups, which hold every default already.
        torch.optim.Optimizer.__init__(self, base.param_groups, base.defaults)
        self.param_groups = base.param_groups  # one list of the same dicts

    def state_dict(self) -> dict[str, Any]:
        """The wrapper's state with the base's under ``"base"``."""
        return {**super().state_dict(), "base": self.base.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        base = state_dict.pop("base")
        super().load_state_dict(state_dict)
        self._check_loaded_state()
        self.base.load_state_dict(base)
        self.param_groups = self.base.param_groups  # loading made new group dicts: share the base's again

    def _check_loaded_state(self) -> None:
        """Raise ValueError when the state just loaded is not this wrapper's own kind."""
