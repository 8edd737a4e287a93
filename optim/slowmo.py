"""SlowMo (Wang, Tantia, Ballas, Rabbat; ICLR 2020): local base-optimizer steps, periodic exact parameter
averaging, and a slow momentum step on the averaged displacement."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from core.options import check_non_negative, check_positive, require
from optim._math import FOREACH_CHUNK_NUMEL, closure_loss
from optim._registry import OptimSpec, get_optimizer_spec, list_optimizers, register_optimizer, run_check
from optim.base_optimizer import BaseWrapper, build_base, check_base_options
from optim.comm import Comm, average_tensors_
from optim.flat import FlatLayout, FlatState, pop_flat_entries
from optim.memory import wrapper_bytes
from optim.option_checks import check_flags
from optim.restart import restart_optimizer

_GLOBAL = "slowmo"  # key of the optimizer-wide entry of `self.state` (the others are parameters)
_FLAT = ("anchor", "slow_momentum")  # per-parameter state, views of flat fp32 buffers


def base_names() -> list[str]:
    """What `base` may name: `sgd` and every registered optimizer that leaves gradient sync to DDP."""
    return ["sgd", *(name for name in list_optimizers() if get_optimizer_spec(name).grad_sync == "ddp")]


class SlowMo(BaseWrapper):
    r"""Slow Momentum (Wang, Tantia, Ballas, Rabbat; ICLR 2020, arXiv 1910.00643, Algorithm 1) over a base optimizer.

    Register with ``grad_sync="self"``: there is no gradient all-reduce. Each rank steps the base optimizer
    (``base``: SGD, AdamW, LAMB, LARS) on its local gradients; after every ``sync_interval`` (:math:`\tau`)
    steps the parameters are averaged exactly over the ranks and the slow momentum step follows. With the
    base LR :math:`\gamma_t` at that step, anchor :math:`x_{t,0}` (the weights after the previous outer step)
    and slow momentum :math:`u` (0 at the start):

    .. math::
        \bar x &= \tfrac1N \textstyle\sum_i x^{(i)}_{t,\tau} \quad \text{(one bucketed all-reduce)} \\
        u_{t+1} &= \beta u_t + (x_{t,0} - \bar x) / \gamma_t \\
        x_{t+1,0} &= x_{t,0} - \alpha \gamma_t u_{t+1}, \qquad x^{(i)} \leftarrow x_{t+1,0} \text{ on every rank}

    with :math:`\beta` = ``slow_momentum`` and :math:`\alpha` = ``slow_lr``; the same recursion as fairscale's
    ``SlowMoDistributedDataParallel`` and torchdistx's ``SlowMomentumOptimizer``. Dividing by :math:`\gamma_t`
    keeps :math:`u` in gradient units across LR changes. :math:`\gamma_t` is each param group's current
    ``lr``; where it is 0 (the last step of a decay to 0) the outer step takes its limit: :math:`u` only decays
    (:math:`u \leftarrow \beta u`) and :math:`x_{t+1,0} = x_{t,0} - \alpha (x_{t,0} - \bar x)`.
    :math:`\alpha = 1, \beta = 0` is the base with periodic averaging (Local SGD for SGD); with
    :math:`\tau = 1` and an SGD base (any momentum, Nesterov, decay: all linear in the gradient) that is
    data-parallel SGD. Adaptive bases (AdamW, LAMB, LARS) are not linear, so there it is not.

    Param groups are the base's own (the same dicts), so the trainer's schedule, which writes ``lr`` into
    ``param_groups``, reaches the base; weight decay is the group's, as for the base alone.

    Args:
        params: parameters or param groups (see `optim.param_groups_weight_decay`).
        lr: the base LR :math:`\gamma`, set each step by the trainer's schedule.
        weight_decay: the base's weight decay, for groups that do not set their own.
        base: ``"sgd"`` (``torch.optim.SGD``) or a registered optimizer whose gradient sync is DDP's.
        base_options: the base's other keyword arguments (``momentum``, ``betas``, ...); unset ones are the
            base class's defaults.
        sync_interval: :math:`\tau`, base steps between averages (fairscale's ``slowmo_frequency``, 48).
        slow_momentum: :math:`\beta` (fairscale 0.5).
        slow_lr: :math:`\alpha` (fairscale 1.0).
        average_buffers: also average the base's per-parameter state tensors at each sync (its momentum
            buffers, Adam moments: every floating state tensor shaped like its parameter), which the paper
            offers so that adaptive states do not drift apart. Costs their size in traffic.
        bucket_mb: the average goes out in all-reduces of at most this many MB (fp32), one per bucket.
        comm: the communication layer (`optim.comm.Comm`); None builds one over the default process group,
            or a world of one when there is none.

    Traffic: ``32 d / sync_interval`` bits per step for ``d`` parameters, plus the base's state tensors with
    ``average_buffers``; nothing is sent between syncs. Model buffers (batch-norm statistics) are not the
    optimizer's and are not averaged (BERT and Swin have none that train).

    State (all in `state_dict()`): per parameter ``anchor`` (:math:`x_{t,0}`) and ``slow_momentum``
    (:math:`u`), both fp32 views of flat buffers (`optim.flat`: one op per param group and chunk for the outer
    step, loaded in place), created at the first step (after the trainer's set-up broadcast); under the key
    ``"slowmo"`` the base steps taken; and, under ``"base"``, the base optimizer's state. Between syncs the
    weights and the base's state differ across ranks, so checkpoints are per rank, and rank 0's weights are the
    averaged ones only right after a sync: evaluate and export at multiples of ``sync_interval``.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 0.1,
        weight_decay: float = 0.0,
        base: str = "sgd",
        base_options: dict[str, Any] | None = None,
        sync_interval: int = 48,
        slow_momentum: float = 0.5,
        slow_lr: float = 1.0,
        average_buffers: bool = False,
        bucket_mb: float = 64.0,
        comm: Comm | None = None,
    ) -> None:
        run_check("SlowMo", check_slowmo_options, dict(
            lr=lr, weight_decay=weight_decay, base=base, base_options=base_options, sync_interval=sync_interval,
            slow_momentum=slow_momentum, slow_lr=slow_lr, average_buffers=average_buffers, bucket_mb=bucket_mb,
        ))
        self._adopt(build_base(base, params, lr, weight_decay, base_options))
        self.sync_interval = int(sync_interval)
        self.slow_momentum, self.slow_lr = float(slow_momentum), float(slow_lr)
        self.average_buffers = bool(average_buffers)
        self.bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
        self.comm = comm if comm is not None else Comm()
        self.state[_GLOBAL] = {"step": 0}
        self.flat: FlatState | None = None  # anchors and slow momenta, made at the first step or a load

    def _check_loaded_state(self) -> None:
        if _GLOBAL not in self.state:
            raise ValueError("SlowMo.load_state_dict: no 'slowmo' entry (steps taken); not a SlowMo state_dict")

    @torch.no_grad()
    def step(self, closure=None):
        """One base step on the local gradients; after every `sync_interval`-th, the average and the outer step."""
        loss = closure_loss(closure)
        self._init_state()
        self.base.step()
        glob = self.state[_GLOBAL]
        glob["step"] += 1
        if glob["step"] % self.sync_interval == 0:
            self._outer_step()
        return loss

    def replicas_agree_after(self, step: int) -> bool:
        """Whether every rank holds the same weights after optimizer step `step` (only right after a sync)."""
        return step % self.sync_interval == 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()`, the anchors and slow momenta straight into the flat buffers (torch's loader
        would first copy them to the parameters' device)."""
        small, flat = pop_flat_entries(state_dict, _FLAT)
        super().load_state_dict(small)
        if all(value is None for value in flat["anchor"]):  # saved before the first step: made at the next one
            self.flat = None
            return
        state = self._flat_state()
        for key in _FLAT:
            state.load_(key, flat[key])

    def restart(self, saved: dict[str, Any]) -> None:
        """Continue another run's state with fresh step counts (`optim.restart`). The anchors are positions, not
        moments: they become the weights this run starts from, so the first outer step sees only this run's own
        displacement; the slow momentum continues."""
        restart_optimizer(self, saved)
        if self.flat is not None:
            torch._foreach_copy_(self.flat.views("anchor"), self._params())

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _flat_state(self) -> FlatState:
        """The flat buffers of the anchors and slow momenta, zero at first, their views in `state`."""
        if self.flat is None:
            params = self._params()
            if len({p.device for p in params}) > 1:
                raise ValueError("SlowMo keeps its state in flat buffers: all parameters must be on one device")
            groups = [index for index, group in enumerate(self.param_groups) for _ in group["params"]]
            layout = FlatLayout.packed([p.shape for p in params], groups)
            self.flat = FlatState(layout, params[0].device, torch.float32)
            for key in _FLAT:
                self.flat.add(key, params, self.state)
        for p, anchor, momentum in zip(self._params(), self.flat.views("anchor"), self.flat.views("slow_momentum"),
                                       strict=True):
            self.state[p]["anchor"], self.state[p]["slow_momentum"] = anchor, momentum  # again after a load
        return self.flat

    def _init_state(self) -> None:
        """Anchors are the weights before the first base step: by then every rank holds rank 0's."""
        if self.flat is None:
            torch._foreach_copy_(self._flat_state().views("anchor"), self._params())

    def _outer_step(self) -> None:
        params = self._params()
        if self.comm.distributed:
            average_tensors_(params + (self._base_buffers(params) if self.average_buffers else []), self.comm,
                             self.bucket_numel)
        flat = self._flat_state()
        # In chunks of the device's FOREACH_CHUNK_NUMEL: the drift's temporary is one chunk's, not the model's
        # (12 GB for BERT-XL's 2.9B parameters), and its passes stay in a CPU's cache.
        limit = FOREACH_CHUNK_NUMEL.get(flat.device.type)
        work = torch.empty(min(limit or flat.layout.numel, flat.layout.numel), device=flat.device)
        for chunk, anchor, momentum, anchors in zip(flat.chunks(limit), flat.chunk_views("anchor", limit),
                                                    flat.chunk_views("slow_momentum", limit),
                                                    flat.pieces("anchor", limit), strict=True):
            drift = work[:chunk.stop - chunk.start]
            pieces = [piece.of(params[piece.slot]) for piece in chunk.pieces]
            torch._foreach_copy_([d.view_as(p) for d, p in zip(drift.split([p.numel() for p in pieces]), pieces,
                                                               strict=True)], pieces)  # x_bar, in fp32
            slow_momentum_step_(drift, anchor, momentum, lr=self.param_groups[chunk.group]["lr"],
                                slow_momentum=self.slow_momentum, slow_lr=self.slow_lr)
            torch._foreach_copy_(pieces, anchors)

    def _base_buffers(self, params: list[Tensor]) -> list[Tensor]:
        """The base's per-parameter state tensors shaped like their parameter, in a rank-independent order."""
        buffers = []
        for p in params:
            state = self.base.state.get(p, {})
            buffers += [value for key, value in sorted(state.items())
                        if key != "step" and torch.is_tensor(value) and value.is_floating_point()
                        and value.shape == p.shape]
        return buffers


def slow_momentum_step_(drift: Tensor, anchor: Tensor, momentum: Tensor, *, lr: float, slow_momentum: float,
                        slow_lr: float) -> None:
    """The outer step of one run of one param group's flat state, in place: `drift` holds the averaged weights
    on entry (and is used as scratch); `anchor` (the new anchor on exit) and `momentum` (u) are updated (see
    `SlowMo`)."""
    torch.sub(anchor, drift, out=drift)  # x_{t,0} - x_bar
    momentum.mul_(slow_momentum)
    if lr > 0:
        drift.div_(lr)
        momentum.add_(drift)
        anchor.add_(momentum, alpha=-slow_lr * lr)
    else:  # the limit lr -> 0 of the update: the displacement, not u, moves the anchor
        anchor.add_(drift, alpha=-slow_lr)


def check_slowmo_options(options: dict[str, Any]) -> None:
    """SlowMo's value checks, the base's included, run by its constructor and, through the registry, on the
    config before any worker. A bad base option is named `base_options.<key>`."""
    o = options
    check_non_negative("lr", o["lr"])
    check_non_negative("weight_decay", o["weight_decay"])
    check_base_options(o, base_names(), "SlowMo")
    interval = o["sync_interval"]
    require(isinstance(interval, int) and not isinstance(interval, bool) and interval >= 1, "sync_interval",
            interval, "must be an integer >= 1")
    slow_momentum = o["slow_momentum"]
    require(isinstance(slow_momentum, int | float) and 0.0 <= slow_momentum < 1.0, "slow_momentum", slow_momentum,
            "must be in [0, 1)")
    check_positive("slow_lr", o["slow_lr"])
    check_flags(o, "average_buffers")
    check_positive("bucket_mb", o["bucket_mb"])


register_optimizer(OptimSpec(
    "slowmo", SlowMo, "self", check=check_slowmo_options, replicas_agree_after=SlowMo.replicas_agree_after,
    restart=SlowMo.restart,
    state_bytes_per_param=wrapper_bytes(8.0),  # fp32 anchor and slow momentum on top of the base's
    description="SlowMo (Wang et al., ICLR 2020): local steps of a base optimizer, exact parameter averaging "
                "every sync_interval steps and a slow momentum step",
))
