"""Split a model's trainable parameters into a weight-decay group and a no-decay group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

# NVIDIA BERT exempts names containing 'bias', 'gamma', 'beta' or 'LayerNorm'; with `ndim <= 1` below this
# also covers timm's `norm*` layers and Swin's 2-D `relative_position_bias_table`.
NO_DECAY_PATTERNS: tuple[str, ...] = ("bias", "LayerNorm", "norm")


def param_groups_weight_decay(
    model: nn.Module, weight_decay: float, no_decay_patterns: Sequence[str] = NO_DECAY_PATTERNS, named: bool = False
) -> list[dict[str, Any]]:
    """Groups `[{"name": "decay", ...}, {"name": "no_decay", "weight_decay": 0.0, ...}]`, empty ones dropped.

    A trainable parameter goes to `no_decay` when it has `ndim <= 1` (biases, norm scales and shifts), when
    its qualified name contains one of `no_decay_patterns` (plain substrings), or when the model names it
    in `no_weight_decay()` (timm's convention, e.g. Swin's position embeddings). Decaying those hurts
    accuracy and is not what the published recipes do. Frozen parameters are left out. With `named`, each
    group's `params` are `(qualified name, parameter)` pairs, which torch optimizers keep as `param_names`.
    """
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, param in model.named_parameters():  # tied weights are listed once
        if not param.requires_grad:
            continue
        exempt = param.ndim <= 1 or name in skip or any(pattern in name for pattern in no_decay_patterns)
        (no_decay if exempt else decay).append(param)

    trainable = [p for p in model.parameters() if p.requires_grad]
    grouped = {id(p) for p in decay} | {id(p) for p in no_decay}
    if len(decay) + len(no_decay) != len(trainable) or grouped != {id(p) for p in trainable}:
        raise AssertionError("param groups must hold every trainable parameter exactly once")
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if named:
        names = {id(param): name for name, param in model.named_parameters()}
        for group in groups:
            group["params"] = [(names[id(param)], param) for param in group["params"]]
    return [group for group in groups if group["params"]]
