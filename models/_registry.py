"""A name -> builder registry for models, filled by the `@register_model` decorator, the models' config check, and
the check that a model can start from given weights (`trainer.init_from`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from core.options import check_kwargs, options_of
from core.registry import Registry


@dataclass(frozen=True)
class ModelSpec:
    """A builder and the check of its options (raising `InvalidOption`), run at compose time without weights."""

    name: str  # the builder's own name, as `model.name` in conf/model/*.yaml
    build: Callable[..., nn.Module]
    family: str  # the weights it starts from: an export's transformers model_type ("bert") or timm family ("swin")
    check: Callable[..., None] | None = None
    in_use: Callable[..., dict[str, Any]] | None = None  # the options with the values their nulls stand for
    # Why the builder's options cannot take an export of its family (its config.json), or None; without it the
    # export's weights are checked tensor by tensor.
    export_refusal: Callable[[Mapping[str, Any], Mapping[str, Any], Path], str | None] | None = None
    # The modules of a built model that torch.compile compiles one at a time (`models.compiled_for_training`), or
    # None to compile the whole model: one compile serves every instance of a repeated block.
    compile_regions: Callable[[nn.Module], Iterable[nn.Module]] | None = None


# Filled by the model modules of `models/`, which it imports on its first lookup.
MODELS: Registry[ModelSpec] = Registry("model", "model.name", "models")


def register_model(*, family: str, check: Callable[..., None] | None = None,
                   in_use: Callable[..., dict[str, Any]] | None = None,
                   export_refusal: Callable[[Mapping[str, Any], Mapping[str, Any], Path], str | None] | None = None,
                   compile_regions: Callable[[nn.Module], Iterable[nn.Module]] | None = None) -> Any:
    """Register a builder under its own function name: `@register_model(family="bert", check=...)`.

    `family` names the weights the model starts from (`ModelSpec.family`). `check` takes the builder's keyword
    arguments (None ones dropped, as `create_model` does) and raises `InvalidOption` for a value that cannot build;
    `in_use` takes them too and returns them with each null replaced by the value the builder uses for it (BERT's
    shape from its `size`); `export_refusal` takes them, an export's config.json and its directory;
    `compile_regions` takes a built model and returns the modules `trainer.compile` compiles one by one
    (`ModelSpec.compile_regions`). A second builder with the same name is an error.
    """

    def add(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        MODELS.register(builder.__name__, ModelSpec(builder.__name__, builder, family, check, in_use, export_refusal,
                                                    compile_regions))
        return builder

    return add


def list_models() -> list[str]:
    return MODELS.names()


def _spec(name: str) -> ModelSpec:
    return MODELS.get(name)


def check_model_config(name: str, kwargs: Mapping[str, Any]) -> None:
    """Compose-time check of `model.name` and its options; errors name the key (`model.num_attention_heads=...`)."""
    spec = MODELS.get(name)
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


EXPORT_CONFIG = "config.json"  # what transformers' save_pretrained and timm's save_for_hf both write


def export_holds(directory: Path) -> tuple[str, str]:
    """What the export in `directory` holds, from its config.json: its family (transformers' model_type, or a
    timm architecture's first word) and words for it ("a transformers BertForQuestionAnswering export")."""
    config = json.loads((Path(directory) / EXPORT_CONFIG).read_text())
    if "architecture" in config:  # timm's save_for_hf
        return config["architecture"].split("_")[0], f"a timm {config['architecture']} export"
    model_type = config.get("model_type", "?")
    architectures = ", ".join(config.get("architectures") or [model_type])
    return model_type, f"a transformers {architectures} export"


def init_refusal(name: str, options: Mapping[str, Any], directory: Path, run_model: str | None) -> str | None:
    """Why model `name`, built with `options`, cannot start from the weights in `directory`, naming what they hold
    and what the model wants; None when it can. An export says what it holds in its config.json; a run's or one of
    its checkpoints' weights are its model's, `run_model` (None: not known, the tensors are checked instead)."""
    spec = _spec(name)
    if run_model is not None:
        family = _spec(run_model).family if run_model in MODELS else run_model
        holds = f"a run of model.name={run_model}"
    elif (Path(directory) / EXPORT_CONFIG).is_file():
        family, holds = export_holds(directory)
    else:
        return None
    if family != spec.family:
        return (f"holds {holds} ({family} weights), and model.name={name} starts from {spec.family} weights: give "
                f"a {spec.family} run or export, or a {family} model")
    if run_model is None and spec.export_refusal is not None:
        config = json.loads((Path(directory) / EXPORT_CONFIG).read_text())
        refusal = spec.export_refusal({k: v for k, v in options.items() if v is not None}, config, Path(directory))
        return None if refusal is None else f"holds {holds} {refusal}"
    return None
