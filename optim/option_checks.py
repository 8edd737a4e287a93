"""The value checks the optimizers' options share (the Adam four, switches): each optimizer's check starts with
them, in its constructor and, through the registry, on the config before any worker starts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.options import check_non_negative, require


def check_adam_hyperparameters(options: Mapping[str, Any]) -> None:
    """The Adam family's `lr`, `betas`, `eps`, `weight_decay`: an `InvalidOption` naming the first bad one.

    The check of `adamw` and the first part of every other optimizer's check (constructors and config alike).
    """
    check_non_negative("lr", options["lr"])
    betas = options["betas"]
    require(isinstance(betas, Sequence) and len(betas) == 2 and all(0.0 <= beta < 1.0 for beta in betas),
            "betas", betas, "must be two values in [0, 1)")
    check_non_negative("eps", options["eps"])
    check_non_negative("weight_decay", options["weight_decay"])


def check_flags(options: Mapping[str, Any], *keys: str) -> None:
    """Options that are switches must be true or false (a string or a pair is some other optimizer's option)."""
    for key in keys:
        require(isinstance(options[key], bool), key, options[key], "must be true or false")
