"""A name -> builder registry for models, filled by the `@register_model` decorator, and the models' config check."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from conf.checks import ConfigError, check_kwargs, options_of


@dataclass(frozen=True)
class ModelSpec:
    """A builder and the check of its options (raising `InvalidOption`), run at compose time without weights."""

    name: str  # the builder's own name, as `model.name` in conf/model/*.yaml
    build: Callable[..., nn.Module]
    check: Callable[..., None] | None = None
    in_use: Callable[..., dict[str, Any]] | None = None  # the options with the values their nulls stand for


_MODELS: dict[str, ModelSpec] = {}


def register_model(fn: Callable[..., nn.Module] | None = None, *, check: Callable[..., None] | None = None,
                   in_use: Callable[..., dict[str, Any]] | None = None) -> Any:
    """Register a builder under its own function name (`@register_model` or `@register_model(check=...)`).

    `check` takes the builder's keyword arguments (None ones dropped, as `create_model` does) and raises
    `InvalidOption` for a value that cannot build; `in_use` takes them too and returns them with each null replaced
    by the value the builder uses for it (BERT's shape from its `size`). A second builder with the same name is an
    error.
    """

    def add(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if builder.__name__ in _MODELS:
            raise ValueError(f"model '{builder.__name__}' is registered twice")
        _MODELS[builder.__name__] = ModelSpec(builder.__name__, builder, check, in_use)
        return builder

    return add if fn is None else add(fn)


def list_models() -> list[str]:
    return sorted(_MODELS)


def _spec(name: str) -> ModelSpec:
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model '{name}'; known models: {', '.join(list_models())}") from None


def check_model_config(name: str, kwargs: Mapping[str, Any]) -> None:
    """Compose-time check of `model.name` and its options; errors name the key (`model.num_attention_heads=...`)."""
    if name not in _MODELS:
        raise ConfigError(f"model.name={name} is not a registered model; known models: {', '.join(list_models())}")
    spec = _MODELS[name]
    with options_of("model"):
        check_kwargs(spec.build, kwargs, owner=f"model '{name}'")
        if spec.check is not None:
            spec.check(**{k: v for k, v in kwargs.items() if v is not None})


def model_options_in_use(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A checked model's options as the builder uses them, so a refusal names the value in use, not a null."""
    in_use = _spec(name).in_use
    plain = {k: v for k, v in kwargs.items() if v is not None}
    return dict(kwargs) if in_use is None else {**kwargs, **in_use(**plain)}


def create_model(name: str, **kwargs: Any) -> nn.Module:
    """Build model `name`; kwargs that are None are dropped so the builder's own defaults apply."""
    return _spec(name).build(**{k: v for k, v in kwargs.items() if v is not None})
