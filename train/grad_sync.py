"""Who makes gradients global: DDP's all-reduce, or the optimizer itself. The trainer asks the optimizer once.

An optimizer's registry record says `grad_sync="ddp"` (LAMB, AdamW: gradients are all-reduced by DDP during
backward, through a hook that counts bytes) or `grad_sync="self"` (SLAMB, the 1-bit family: no gradient
all-reduce; `step()` communicates what its algorithm says). Everything that follows from that choice lives
here: wrapping the model, the initial broadcast, skipping the all-reduce on all but the last micro-batch,
agreeing on fp16 overflows, and which part of a checkpoint is the same on every rank.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from optim.comm import Comm
from train.allreduce_hook import AllReduceHookState, counting_allreduce_hook

# State of the learner (model, optimizer, EMA): identical on every rank under DDP, per rank otherwise.
LEARNER_KEYS = ("model", "optimizer", "ema")


class GradSync:
    """The DDP policy; `SelfSync` overrides what differs when the optimizer synchronises itself."""

    kind = "ddp"

    def __init__(self, comm: Comm, device: torch.device, wire_dtype: str = "fp32") -> None:
        self.comm, self.device, self.wire_dtype = comm, device, wire_dtype
        self._ddp: DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP with the byte-counting all-reduce hook in the wire dtype (DDP broadcasts rank 0's weights).

        Gradients are views into DDP's all-reduce buckets (`gradient_as_bucket_view`): one copy of them instead
        of two, a model's worth of memory that BERT-Large on an 80 GB GPU needs. Zeroing them to None between
        steps stays correct: DDP copies a fresh gradient into its bucket and points `.grad` back at it.
        """
        if not self.comm.distributed:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self._ddp = DistributedDataParallel(model, device_ids=device_ids, process_group=self.comm.group,
                                            gradient_as_bucket_view=True, **_buffer_sync(model))
        self._ddp.register_comm_hook(AllReduceHookState(self.comm, self.wire_dtype), counting_allreduce_hook)
        return self._ddp

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Gradients are made global only after the last micro-batch: DDP's all-reduce is skipped before it."""
        if last or self._ddp is None:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def agree_on_weights(self, model: nn.Module) -> None:
        """Broadcast rank 0's weights and buffers, so that every replica starts identical (set-up, not counted).
        `wrap` does it for the model it wraps; O2 does it for the fp32 masters its half copy is made from."""
        if self.comm.distributed:
            for tensor in model.state_dict().values():
                self.comm.broadcast(tensor)
            self.comm.take_counts()  # the initial broadcast is set-up, not per-step traffic

    def agree_on_overflow(self, grads: list[torch.Tensor]) -> None:
        """Nothing to do: after DDP's all-reduce every rank holds the same gradients, so its scaler agrees."""

    def split_state(self, learner: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, own) parts of the learner's state for a checkpoint: DDP replicas are identical."""
        return learner, {}

    def learner_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        """The learner's state back from a checkpoint's shared and own parts."""
        return {key: shared[key] for key in LEARNER_KEYS if key in shared}


class SelfSync(GradSync):
    """The optimizer communicates by itself: no DDP, an identical start, per-rank learner state."""

    kind = "self"

    def wrap(self, model: nn.Module) -> nn.Module:
        """Broadcast rank 0's weights so that every replica starts identical; no DDP."""
        self.agree_on_weights(model)
        return model

    def agree_on_overflow(self, grads: list[torch.Tensor]) -> None:
        """Make one rank's fp16 overflow skip the step on every rank, without reading anything on the host.

        Each rank sees only its local gradients: if ranks decided alone, one would skip while the others step
        into a collective it never joins, and their loss scales would drift apart. The overflow flags are
        all-reduced on the device, and an agreed overflow is written as an inf into one gradient element of
        every rank, which each rank's scaler then finds and skips. Indexing (not `.view`) keeps this working on
        non-contiguous gradients (channels_last).
        """
        if not self.comm.distributed or not grads:
            return
        local = ~torch.isfinite(torch.stack(torch._foreach_norm(grads, math.inf)).max())  # max-norm: no overflow
        agreed = self.comm.any_on_device(local)
        first = grads[0]
        first[(0,) * first.ndim].add_(torch.where(agreed, math.inf, 0.0).to(first.dtype))

    def split_state(self, learner: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Moments (and, between syncs, weights) differ across ranks: each rank keeps its own."""
        return {}, learner

    def learner_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        return {key: own[key] for key in LEARNER_KEYS if key in own}


def _buffer_sync(model: nn.Module) -> dict[str, bool]:
    """DDP's per-forward broadcast of rank 0's buffers, off unless training changes a buffer.

    BERT's and Swin's buffers (position and token-type ids, relative position indices, attention masks) are
    constants, identical on every rank from construction: broadcasting them before every forward is a collective
    per micro-batch for nothing. BatchNorm's running statistics do change, per rank: for a model with them the
    broadcast stays on, so that every replica evaluates and checkpoints rank 0's statistics.
    """
    if _trains_buffers(model):
        return {}
    # torch 2.13 renamed the option (and, unlike the old one, it keeps the buffers' broadcast at construction);
    # container images may carry an older torch.
    takes_new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if takes_new_name else "broadcast_buffers": False}


def _trains_buffers(model: nn.Module) -> bool:
    """Whether a training step changes one of the model's buffers (running statistics of a norm layer)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules())


_POLICIES: dict[str, type[GradSync]] = {"ddp": GradSync, "self": SelfSync}


def build_grad_sync(kind: str, comm: Comm, device: torch.device, wire_dtype: str = "fp32") -> GradSync:
    """The policy for an optimizer's registered `grad_sync` kind ("ddp" or "self"); `wire_dtype` is the DDP
    gradient all-reduce's (`trainer.grad_allreduce_dtype`; self-synchronising optimizers have their own)."""
    return _POLICIES[kind](comm, device, wire_dtype)
