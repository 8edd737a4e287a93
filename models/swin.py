"""Swin Transformer classifiers from timm, by architecture name with shape overrides for small variants.

`swin(arch="swin_base_patch4_window7_224")` is the paper's Swin-B (88M parameters); overriding the shape
(`img_size=32, patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4`) gives the
sub-million-parameter models the tests and the digits demo train on CPU. Weights are never downloaded
(`pretrained=False`): runs train from scratch, offline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.options import InvalidOption
from models._registry import register_model


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the image batch in NHWC memory, matching the patch-embedding conv's weight."""
    return (args[0].contiguous(memory_format=torch.channels_last), *args[1:])


def check_swin_options(arch: str = "swin", depths: Sequence[int] | None = None,
                       num_heads: Sequence[int] | None = None, **_: Any) -> None:
    """Compose-time check of what timm would reject only once it builds: the architecture and the stage lists."""
    if not arch.startswith("swin"):
        import timm

        raise InvalidOption("arch", f"is not a Swin architecture; known: {', '.join(timm.list_models('swin*'))}", arch)
    if depths is not None and num_heads is not None and len(depths) != len(num_heads):
        raise InvalidOption("num_heads", f"must have one entry per stage, as depths={list(depths)}", list(num_heads))


@register_model(family="swin", check=check_swin_options)
def swin(
    arch: str = "swin_base_patch4_window7_224",
    num_classes: int = 1000,
    img_size: int | None = None,
    patch_size: int | None = None,
    embed_dim: int | None = None,
    depths: Sequence[int] | None = None,
    num_heads: Sequence[int] | None = None,
    window_size: int | None = None,
    mlp_ratio: float | None = None,
    drop_rate: float | None = None,
    drop_path_rate: float = 0.1,
    channels_last: bool = False,
    grad_checkpointing: bool = False,
) -> nn.Module:
    """A timm Swin `arch`; shape arguments left None keep the architecture's own values.

    `channels_last` stores the patch-embedding conv in NHWC and converts every input batch to it (on GPUs
    cuDNN then runs the conv without layout transposes, and timm's NCHW -> NHWC permute after it is free).
    `grad_checkpointing` recomputes each block's activations in backward (timm's `set_grad_checkpointing`):
    about a third more compute for a much smaller activation memory, so larger micro-batches fit.
    """
    import timm  # here, not at module top: BERT-only runs need not pay timm's import time

    check_swin_options(arch=arch, depths=depths, num_heads=num_heads)
    overrides = {
        "img_size": img_size, "patch_size": patch_size, "embed_dim": embed_dim,
        "depths": tuple(depths) if depths is not None else None,
        "num_heads": tuple(num_heads) if num_heads is not None else None,
        "window_size": window_size, "mlp_ratio": mlp_ratio, "drop_rate": drop_rate,
    }
    model_args = {"num_classes": num_classes, "drop_path_rate": drop_path_rate,
                  **{k: v for k, v in overrides.items() if v is not None}}
    model = timm.create_model(arch, pretrained=False, **model_args)
    model.model_args = model_args  # what export_timm_model writes, so timm can rebuild the same shape
    if channels_last:
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_to_channels_last)
    if grad_checkpointing:
        model.set_grad_checkpointing(True)
    return model


# What `export_timm_model(data_config=...)` takes: the run's preprocessing (cfg.data), in timm's terms.
DATA_CONFIG_KEYS = ("mean", "std", "crop_pct", "interpolation", "input_size", "crop_mode")
# pretrained_cfg fields that describe timm's published weights (their tag and licence), not ours.
_SOURCE_FIELDS = ("tag", "license", "url", "hf_hub_id", "hf_hub_filename", "file", "source", "paper_ids",
                  "paper_name", "notes", "origin_url")


def timm_data_config(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run's preprocessing as timm's `save_for_hf(data_config=...)` takes it.

    `input_size` is the image side (`data.img_size`), an (H, W) pair or timm's (C, H, W); the eval transform
    crops the centre (data/images/transforms.py), so `crop_mode` defaults to "center".
    """
    unknown = sorted(set(data_config) - set(DATA_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"data_config has unknown keys {unknown}; known: {', '.join(DATA_CONFIG_KEYS)}")
    config: dict[str, Any] = {"crop_mode": "center"}
    for key, value in data_config.items():
        if value is None:
            continue
        if key in ("mean", "std"):
            value = tuple(float(v) for v in value) if isinstance(value, Sequence) else (float(value),)
        elif key == "crop_pct":
            value = float(value)
        elif key == "input_size":
            size = tuple(int(v) for v in value) if isinstance(value, Sequence) else (int(value),) * 2
            if len(size) not in (2, 3):
                raise ValueError(f"data_config input_size must be a side, (H, W) or (C, H, W); got {value!r}")
            key, value = ("img_size", size) if len(size) == 2 else ("input_size", size)
        config[key] = value
    return config


def export_timm_model(model: nn.Module, directory: Path, data_config: Mapping[str, Any] | None = None,
                      label_names: Sequence[str] | None = None) -> Path:
    """Write `model.safetensors` + timm's `config.json` into `directory`.

    The result loads with `timm.create_model(f"local-dir:{directory}", pretrained=True)` (the architecture
    and the shape overrides travel in the config) and with `trainer.init_from=<directory>`.

    `data_config` (keys `DATA_CONFIG_KEYS`: mean, std, crop_pct, interpolation, input_size) is the
    preprocessing the run trained and evaluated with; it goes into the config's `pretrained_cfg`, so
    `timm.data.resolve_data_config({}, model=<loaded model>)` gives the run's values. Without it the
    architecture's ImageNet defaults stay there. `label_names` (each output's class, in order: an ImageFolder's
    folder names) goes into the config, and timm loads it into `pretrained_cfg["label_names"]`. Either way the
    source weights' tag and licence are dropped: these weights were trained here (the builder never downloads any).
    """
    from timm.models import save_for_hf

    timm_data = timm_data_config(data_config) if data_config is not None else None
    original = model.pretrained_cfg
    model.pretrained_cfg = {k: v for k, v in original.items() if k not in _SOURCE_FIELDS}
    try:
        save_for_hf(model, str(directory), model_args=getattr(model, "model_args", None), safe_serialization=True,
                    data_config=timm_data, model_config={"label_names": list(label_names)} if label_names else None)
    finally:
        model.pretrained_cfg = original
    return Path(directory)
