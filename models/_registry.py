"""A name -> builder registry for models, filled by the `@register_model` decorator."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register a builder under its own function name; a second builder with the same name is an error."""
    if fn.__name__ in _MODELS:
        raise ValueError(f"model '{fn.__name__}' is registered twice")
    _MODELS[fn.__name__] = fn
    return fn


def list_models() -> list[str]:
    return sorted(_MODELS)


def _builder(name: str) -> Callable[..., nn.Module]:
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; known models: {', '.join(list_models())}") from None


def model_kwargs_error(name: str, kwargs: dict[str, Any]) -> str | None:
    """Return a one-line complaint if `kwargs` do not fit the builder `name`, else None (checked before launch)."""
    try:
        builder = _builder(name)
    except ValueError as err:
        return str(err)
    params = inspect.signature(builder).parameters
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        return f"model.{unknown[0]} is not an option of model '{name}'; options: {', '.join(params)}"
    return None


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build model `name`; kwargs that are None are dropped so the builder's own defaults apply."""
    return _builder(name)(**{k: v for k, v in kwargs.items() if v is not None})
