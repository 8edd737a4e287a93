"""JointSpar's base optimizers (SGD, LARS, LAMB) stepped over every sampled layer at once, each tensor with its
layer's 1/p: a fixed number of multi-tensor ops per param group and chunk, however many layers are sampled.

A base steps its own param groups one by one, with one LR (LAMB) or direction scale (SGD, LARS) per group; JointSpar
gives every layer its own 1/p, so with the base's step its ops grew with the layers. Here the per-layer factor is a
per-tensor scalar of one foreach op instead, over the views of the engine's flat state (`optim.flat`). The math is
the base's: LARS's and LAMB's own functional cores (`optim.lars.lars` and `optim.lamb.lamb_update_`, which take
per-tensor scales or LRs), and `torch.optim.SGD`'s multi-tensor step written here with a per-tensor factor (see
`optim.jointspar.JointSpar` for where 1/p enters each). `Sampled` is what one param group hands in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim._math import fused_add_adam_direction_
from optim.flat import foreach_chunks
from optim.lamb import lamb_update_
from optim.lars import lars

# Per-element state of each base, flat buffers named as the base names its state.
STATE_KEYS = {"sgd": ("momentum_buffer",), "lars": ("momentum_buffer",), "lamb": ("exp_avg", "exp_avg_sq")}


@dataclass
class Sampled:
    """The tensors of one param group that a step moves, in the base's order, with their per-tensor scalars.

    `state[key][i]` is tensor i's view of flat buffer `key`; `scales[i]` its layer's 1/p (0 with `decaying`: an
    unsampled layer whose state sees a zero gradient while its weights stay); `fresh[i]`: its state is new this step.
    """

    params: list[Tensor]
    grads: list[Tensor]
    state: dict[str, list[Tensor]]
    scales: list[float]
    fresh: list[bool]

    def chunks(self) -> list[Sampled]:
        """The same, in runs of the device's `FOREACH_CHUNK_NUMEL` elements: temporaries stay one chunk's."""
        return [Sampled(self.params[c], self.grads[c], {k: v[c] for k, v in self.state.items()}, self.scales[c],
                        self.fresh[c]) for c in foreach_chunks(self.params)]


def uses_state(base: str, options: Mapping[str, Any]) -> tuple[str, ...]:
    """The flat buffers base `base` keeps under its options (SGD and LARS: none without momentum)."""
    return STATE_KEYS[base] if base == "lamb" or options["momentum"] != 0 else ()


def sgd_(batch: Sampled, group: Mapping[str, Any], decaying: bool = False) -> None:
    """`torch.optim.SGD` with the direction `(g + lambda x) / p`, written into the gradients; momentum and step in
    torch's fused SGD kernel, where a tensor's first buffer is its direction, undamped, as `SGD` makes it (with
    dampening 0 a zero buffer gives the same: mu 0 + d). `decaying`: zero gradients at LR 0."""
    if not decaying:
        if group["weight_decay"] != 0:
            torch._foreach_add_(batch.grads, batch.params, alpha=group["weight_decay"])
        torch._foreach_mul_(batch.grads, batch.scales)
    buffers = batch.state.get("momentum_buffer", [])
    options = dict(weight_decay=0.0, momentum=group["momentum"], lr=0.0 if decaying else group["lr"],
                   dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
    if not buffers or group["dampening"] == 0 or not any(batch.fresh):
        torch._fused_sgd_(batch.params, batch.grads, buffers, **options, is_first_step=False)
        return
    for first in (True, False):
        picked = [i for i, fresh in enumerate(batch.fresh) if fresh == first]
        if picked:
            torch._fused_sgd_(*([items[i] for i in picked] for items in (batch.params, batch.grads, buffers)),
                              **options, is_first_step=first)


def lars_(batch: Sampled, group: Mapping[str, Any], decaying: bool = False) -> None:
    """`optim.lars.lars` with each tensor's 1/p on its direction before the momentum (on its trust ratio, or on the
    gradient of a tensor that takes none); `decaying`: LR and weight decay 0, as the base with its group's set so."""
    lars(batch.params, batch.grads, batch.state.get("momentum_buffer"),
         adapt=[p.dim() > 1 or not group["exclude_1d"] for p in batch.params],
         lr=0.0 if decaying else group["lr"], momentum=group["momentum"],
         weight_decay=0.0 if decaying else group["weight_decay"], trust_coefficient=group["trust_coefficient"],
         eps=group["eps"], nesterov=group["nesterov"], direction_scales=None if decaying else batch.scales)


def lamb_(batch: Sampled, group: Mapping[str, Any], grad_divisor: Tensor | None, decaying: bool = False) -> None:
    """`optim.lamb.lamb_update_` with each tensor's LR `lr / p`: the trust ratios, or the Adam directions of the
    tensors that take none, carry it. `decaying`: the moments see the zero gradients, the weights stay (LR 0)."""
    beta1, beta2 = group["betas"]
    adam = dict(step=group["step"], beta1=beta1, beta2=beta2, eps=group["eps"],
                bias_correction=group["bias_correction"])
    grads = batch.grads if grad_divisor is None else torch._foreach_div(batch.grads, grad_divisor)
    if decaying:
        fused_add_adam_direction_(batch.params, grads, batch.state["exp_avg"], batch.state["exp_avg_sq"], scale=-0.0,
                                  **adam)
        return
    lamb_update_(batch.params, grads, batch.state["exp_avg"], batch.state["exp_avg_sq"],
                 lr=[group["lr"] * scale for scale in batch.scales], weight_decay=group["weight_decay"],
                 max_ratio=1.0 if group["trust_clip"] else None,
                 adapt=group["weight_decay"] != 0 or group["always_adapt"], **adam)
