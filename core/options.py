"""The value checks every component runs on its options before any worker starts.

Components (data kinds, optimizers, models, schedules) check their own options with these helpers and raise
`InvalidOption` naming the option as the component knows it (`lr`); the compose-time validator names the group
(`optim.lr`). Keys given on the command line are checked against what is there (`refuse_unknown_keys`,
`apply_overrides`).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import difflib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from core.errors import ConfigError, config_error

_UNSET = object()


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


@contextlib.contextmanager
def options_of(group: str) -> Iterator[None]:
    """Inside a component's check, an `InvalidOption("lr", ...)` becomes the `ConfigError` naming `optim.lr`."""
    try:
        yield
    except InvalidOption as err:
        raise err.within(group) from None


def _show(value: Any) -> str:
    """Values as the user writes them: lists and tuples alike as `[a, b]`."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise `InvalidOption(key, why, value)` unless `ok`."""
    if not ok:
        raise InvalidOption(key, why, value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive(key: str, value: Any) -> None:
    require(_is_number(value) and value > 0, key, value, "must be positive")


def check_non_negative(key: str, value: Any) -> None:
    require(_is_number(value) and value >= 0, key, value, "must be >= 0")


def check_choice(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    require(value in allowed, key, value, f"must be one of {', '.join(map(str, allowed))}")


def check_range(key: str, value: Any, low: float, high: float) -> None:
    """`low <= value <= high`."""
    require(_is_number(value) and low <= value <= high, key, value, f"must be in [{low}, {high}]")


def check_kwargs(fn: Callable[..., Any], kwargs: Mapping[str, Any], owner: str, reserved: Iterable[str] = ()) -> None:
    """The one check of config keys against a builder's signature: an unknown key names itself and the options,
    and a value of the wrong kind (`lr=fast` for a float) names itself and the kind the annotation asks for.

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
    hints = _type_hints(fn)
    for key in sorted(kwargs):
        wanted = _wrong_kind(kwargs[key], hints.get(key, Any))
        if wanted is not None:
            raise InvalidOption(key, f"must be {wanted}", kwargs[key])


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The annotations of `fn`'s signature (its `__signature__` if it advertises one), resolved in its module.

    An annotation that cannot be resolved is left out: that parameter's values are not checked for kind.
    """
    target = fn.__init__ if inspect.isclass(fn) else fn
    module = sys.modules.get(getattr(target, "__module__", ""), None)
    namespace = {**vars(typing), **(vars(module) if module is not None else {})}
    hints = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        annotation = parameter.annotation
        if isinstance(annotation, str):  # postponed (`from __future__ import annotations`)
            try:
                annotation = eval(annotation, namespace)  # an annotation of our own code, not user input
            except Exception:
                continue
        if annotation is not inspect.Parameter.empty:
            hints[name] = annotation
    return hints


_KINDS: dict[type, tuple[str, Callable[[Any], bool]]] = {
    float: ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    bool: ("true or false", lambda v: isinstance(v, bool)),
    str: ("a string", lambda v: isinstance(v, str)),
}


def _wrong_kind(value: Any, annotation: Any) -> str | None:
    """What `value` should be, if it does not fit `annotation` (numbers, flags, strings, lists; else unchecked)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        # A tensor-valued hyper-parameter (torch's `lr: float | Tensor`) comes from a config as a number.
        members = [arg for arg in args if arg is not type(None) and getattr(arg, "__name__", "") != "Tensor"]
        wrong = [_wrong_kind(value, arg) for arg in members]
        if (value is None and type(None) in args) or any(w is None for w in wrong):
            return None
        return " or ".join(wrong) + (" or null" if type(None) in args else "")
    if annotation in _KINDS:
        name, fits = _KINDS[annotation]
        return None if fits(value) else name
    if origin in (list, tuple, Sequence, collections.abc.Sequence):
        if isinstance(value, str) or not isinstance(value, Sequence):
            return "a list"
        item = args[0] if args else Any
        return next((f"a list, each item {w}" for v in value if (w := _wrong_kind(v, item)) is not None), None)
    return None


def refuse_unknown_keys(node: Any, prefix: str = "") -> None:
    """Refuse a key no schema declares: `+trainer.max_stpes=5`, Hydra's own suggestion for a typo, adds it past the
    schema, where it would be ignored. Nodes without a schema (`model`, `optim`) check their keys themselves."""
    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    for key, value in node.items_ex(resolve=False):
        if known is not None and key not in known:
            near = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"keys: {', '.join(known)}"
            raise ConfigError(f"{prefix}{key} is not a key of {prefix.rstrip('.') or 'the config'}; {hint}")
        if isinstance(value, DictConfig):
            refuse_unknown_keys(value, f"{prefix}{key}.")


def apply_overrides(cfg: Any, overrides: Sequence[str], owner: str) -> None:
    """Apply command-line `key=value` changes to a config read back from a file (`owner` says which: "the run's
    recorded config"), as strictly as Hydra applies them to a composed one: each key must be there, and a group
    (`model`) stays as recorded, since its keys were checked together. Refusals are one-line `ConfigError`s."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for override in overrides:
        key, equals, _ = override.partition("=")
        if not equals or key.startswith(("+", "~")):
            raise ConfigError(f"{override}: give key=value, to change a key of {owner}")
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if isinstance(node, DictConfig):
            known = [str(k) for k in node]  # unset (???) keys too, which `leaf in node` would miss
        elif isinstance(node, ListConfig):
            known = [str(i) for i in range(len(node))]
        else:
            known = []
        if leaf not in known:
            near = difflib.get_close_matches(leaf, known, n=1)
            hint = f"; did you mean {parent + '.' if parent else ''}{near[0]}?" if near else ""
            raise ConfigError(f"{key} is not a key of {owner}{hint}")
        if isinstance(OmegaConf.select(cfg, key), DictConfig):
            raise ConfigError(f"{override}: {key} is a group of {owner}, which keeps the choice it was trained with; "
                              f"change its keys ({key}.<key>=...)")
    try:
        cfg.merge_with_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise config_error(err) from None
