"""User errors in the config, and the value checks every component runs on its options before any worker starts.

Components (data kinds, optimizers, models, schedules) check their own options with these helpers and raise
`InvalidOption` naming the option as the component knows it (`lr`); the compose-time validator names the group
(`optim.lr`). Everything here is dependency-free, so every package may import it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

_UNSET = object()


class UserError(Exception):
    """Something the user must fix (a value, a file, a directory): the message is one line naming it and what to
    do, and `python -m train` prints it without a traceback and exits with code 2."""


class ConfigError(UserError, ValueError):
    """A value the user must change: one line naming the key and what is allowed (exit code 2, no traceback)."""


class InvalidOption(ConfigError):
    """An option a component rejected, named relative to the component (`lr`); `within` adds the group."""

    def __init__(self, key: str, why: str, value: Any = _UNSET) -> None:
        self.key, self.why, self.value = key, why, value
        super().__init__(self._text(key))

    def _text(self, key: str) -> str:
        return f"{key} {self.why}" if self.value is _UNSET else f"{key}={_show(self.value)} {self.why}"

    def within(self, group: str) -> ConfigError:
        """The same complaint with the key's full name (`optim.lr`), as the user writes it on the command line."""
        return ConfigError(self._text(f"{group}.{self.key}"))


def _show(value: Any) -> str:
    """Values as the user writes them: lists and tuples alike as `[a, b]`."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise `InvalidOption(key, why, value)` unless `ok`."""
    if not ok:
        raise InvalidOption(key, why, value)


def check_positive(key: str, value: Any) -> None:
    require(value is not None and value > 0, key, value, "must be positive")


def check_non_negative(key: str, value: Any) -> None:
    require(value is not None and value >= 0, key, value, "must be >= 0")


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    require(value in allowed, key, value, f"must be one of {', '.join(map(str, allowed))}")


def check_range(key: str, value: Any, low: float, high: float) -> None:
    """`low <= value <= high`."""
    require(value is not None and low <= value <= high, key, value, f"must be in [{low}, {high}]")


def check_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], owner: str, reserved: Iterable[str] = ()) -> None:
    """The one check of config keys against a builder's signature: an unknown key names itself and the options.

    `reserved` are parameters the caller fills itself (`params`, `comm`), never the config.
    """
    reserved = set(reserved)
    parameters = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    options = [name for name in parameters if name not in reserved]
    for key in sorted(kwargs):
        if key not in options:
            raise InvalidOption(key, f"is not an option of {owner}; options: {', '.join(options)}")
