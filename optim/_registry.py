"""The optimizer registry: a frozen `OptimSpec` per name, `check_optimizer_config` and `build_optimizer`.

Each optimizer module registers its own spec: its class, its value check (the same function its constructor
runs), the keyword arguments the entry fixes, and what the trainer may ask of it. The compose-time validator calls
`check_optimizer_config`, before any worker starts, and plans the run with the options it returns; the trainer
builds from them with `build_optimizer(..., checked=True)`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, TypeAlias

import torch
from torch import nn

from core.errors import ConfigError
from core.options import InvalidOption, check_kwargs, options_of
from core.registry import Registry
from optim.param_groups import param_groups_weight_decay
from optim.restart import restart_optimizer

StateBytes: TypeAlias = float | Callable[[dict[str, Any], int], float | None]  # see `OptimSpec.state_bytes_per_param`
_RESERVED = ("params", "comm")  # filled by `build_optimizer`, never by the config
# True while `build_optimizer` builds from options `check_optimizer_config` accepted: constructors skip `run_check`.
_ACCEPTED: ContextVar[bool] = ContextVar("optimizer_options_accepted", default=False)


def replicas_always_agree(optimizer: torch.optim.Optimizer, step: int) -> bool:
    """`OptimSpec.replicas_agree_after` of every optimizer whose ranks hold the same weights after each step."""
    return True


@dataclass(frozen=True)
class OptimSpec:
    """What the trainer needs to know about an optimizer besides its keyword arguments.

    `check` validates a complete set of the class's keyword arguments (every option of its signature but
    `params` and `comm`) and raises `core.options.InvalidOption` naming the bare option (`lr`); the class's
    constructor runs the same function, so the config and a direct call agree on what is valid.

    `defaults` are keyword arguments this entry fixes for its class, applied under the config's values:
    one class can stand under several names with other defaults (as timm's `lambc` is its `Lamb` with
    `trust_clip=True`). Precedence, lowest first: the class signature, `defaults`, the config.

    `samples_layers`: the optimizer picks, each step, which layers compute gradients at all (JointSpar). The
    trainer then calls its `begin_step()` before each step's first forward, compiles the model only region by
    region (a whole-model graph would be rebuilt for every new layer set), and the optimizer gets
    `(name, parameter)` pairs, since its layers are named blocks of the model.

    `state_bytes_per_param`: the optimizer's persistent bytes per trainable parameter element (state and the
    work buffers that grow with the model), for the start-up memory estimate (`optim.memory`): a number, or a
    function of the complete options (as `check` gets them) and the world size. Bounded work pieces and O(1)
    entries are left out. None: not known (the estimate then says so).

    The trainer asks these, and only these, of an optimizer (never its type or name):

    `warmup_option`: the option holding the last step of a full-precision warm-up after which the optimizer
    compresses (the 1-bit optimizers' `freeze_step`); a run no longer than that never compresses, which the
    trainer warns about. None: no such warm-up.

    `replicas_agree_after(optimizer, step)`: whether every rank holds bit-identical weights after optimizer step
    `step` (0: before any step, always True). It must be exact, since where it says False one rank's replica is
    not the model (the trainer averages the replicas for evaluation and export). Asked for the current step and,
    at start-up, for `max_steps`, which may lie ahead. Replicas drift between parameter averages (SlowMo, SLAMB)
    and over 0/1 Adam's local steps; the default, `replicas_always_agree`, holds for every optimizer whose ranks
    all apply the same update each step (DDP's, 1-bit Adam and LAMB, whose compressed all-reduce gives every rank
    the same bytes, and JointSpar, which averages the sampled gradients exactly).

    `restart(optimizer, saved)`: load another run's `state_dict()` with this run's hyper-parameters and every
    step count at 0 (`trainer.init_optimizer_state`, phase 2 of NVIDIA's BERT recipe); `optim.restart`'s generic
    function unless the class keeps step-bound state of its own. `restart_refusal`: why the optimizer cannot
    continue another run's state at all (the run is refused before it starts); None: it can.
    """

    name: str  # same string as conf/optim/<name>.yaml and its `name:` field
    cls: Callable[..., torch.optim.Optimizer]  # a class, or a builder function (apex's classes are imported late)
    grad_sync: Literal["ddp", "self"]  # who makes gradients global: DDP all-reduce, or the optimizer itself
    description: str
    check: Callable[[dict[str, Any]], None]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    samples_layers: bool = False
    state_bytes_per_param: StateBytes | None = None
    warmup_option: str | None = None
    replicas_agree_after: Callable[[torch.optim.Optimizer, int], bool] = replicas_always_agree
    restart: Callable[[torch.optim.Optimizer, dict[str, Any]], None] = restart_optimizer
    restart_refusal: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))  # frozen all the way


# Filled by the optimizer modules of `optim/`, which it imports on its first lookup.
OPTIMIZERS: Registry[OptimSpec] = Registry("optimizer", "optim.name", "optim")


def register_optimizer(spec: OptimSpec) -> OptimSpec:
    """Add `spec` under `spec.name`; a second spec with the same name is an error."""
    if spec.grad_sync not in ("ddp", "self"):
        raise ValueError(f"optimizer '{spec.name}': grad_sync={spec.grad_sync!r} must be 'ddp' or 'self'")
    check_kwargs(spec.cls, spec.defaults, owner=f"optimizer '{spec.name}' (in its registry defaults)",
                 reserved=_RESERVED)
    return OPTIMIZERS.register(spec.name, spec)


def list_optimizers() -> list[str]:
    return OPTIMIZERS.names()


def get_optimizer_spec(name: str) -> OptimSpec:
    """The entry `optim.name` selects; an unknown name is a ConfigError listing the known ones."""
    return OPTIMIZERS.get(name)


def run_check(owner: str, check: Callable[[dict[str, Any]], None], options: dict[str, Any]) -> None:
    """A constructor's call of its `check`: the class's guard for direct use, whose message names the class
    (`LAMB: lr=-1.0 must be >= 0`). Skipped for options `check_optimizer_config` accepted (see `build_optimizer`)."""
    if _ACCEPTED.get():
        return
    with named_by(owner):
        check(options)


@contextlib.contextmanager
def named_by(owner: str) -> Iterator[None]:
    """Inside a constructor, an `InvalidOption` names the class: `LAMB: lr=-1.0 must be >= 0`."""
    try:
        yield
    except InvalidOption as err:
        err.args = (f"{owner}: {err.args[0]}",)  # `err.within("optim")` still gives the config's form
        raise


def check_optimizer_config(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Check an `optim` config node (`name` + keyword arguments) without building anything, and return the
    complete options it checked (class signature, then the entry's defaults, then the config), which
    `build_optimizer(..., checked=True)` builds from.

    Raises `ConfigError` with one line naming the key as the user writes it: `optim.lr=-1 must be >= 0`,
    `optim.momentum is not an option of optimizer 'lamb'; options: ...`, `optim.name=sgdx ...`.
    """
    spec = OPTIMIZERS.get(name)
    with options_of("optim"):
        check_kwargs(spec.cls, kwargs, owner=f"optimizer '{name}'", reserved=_RESERVED)
        options = {**_options(spec.cls), **spec.defaults, **_plain(kwargs)}
        spec.check(options)
    return options


def build_optimizer(
    model: nn.Module, name: str, kwargs: Mapping[str, Any], comm: Any = None, *, checked: bool = False
) -> torch.optim.Optimizer:
    """Build optimizer `name` over `model`'s trainable parameters, from config kwargs over the entry's defaults.

    `weight_decay` goes to the decay group only (biases and norm weights get 0, see `param_groups.py`), and to
    the class as well, whose check sees it (the groups carry their own); the other kwargs go to the class as they
    are. None values are passed on, not dropped: `max_grad_norm: null`
    means "off", not "the class default". Optimizers that synchronise themselves also get `comm`.

    Every value is checked once. A run's options were checked by `check_optimizer_config` in the launching
    process, which returned them complete; built from those (`checked=True`), nothing is checked again: not
    here and not by the constructor, whose `run_check` is the same function on the same values (a check that
    needs the model, as JointSpar's layer budget, still runs: no config check could see it). Direct use
    (tests, benchmarks, a notebook) checks here what the config check finds before the values (unknown keys,
    values of the wrong kind, the latter named by the class as its own check names a bad value) and leaves
    the values to the constructor, as torch's optimizers validate theirs.
    """
    spec = get_optimizer_spec(name)
    if checked:
        kwargs = dict(kwargs)
    else:
        try:
            check_kwargs(spec.cls, kwargs, owner=f"optimizer '{name}'", reserved=_RESERVED)
        except InvalidOption as err:
            if err.key not in inspect.signature(spec.cls).parameters or err.key in _RESERVED:
                raise ConfigError(f"'{err.key}' {err.why}") from None
            err.args = (f"{getattr(spec.cls, '__name__', name)}: {err.args[0]}",)  # `SLAMB: seed=x must be ...`
            raise
        kwargs = {**spec.defaults, **_plain(kwargs)}
    weight_decay = kwargs.get("weight_decay", _options(spec.cls).get("weight_decay", 0.0))
    groups = param_groups_weight_decay(model, weight_decay, named=spec.samples_layers)
    if spec.grad_sync == "self":
        kwargs["comm"] = comm
    accepted = _ACCEPTED.set(checked)
    try:
        return spec.cls(groups, **kwargs)
    finally:
        _ACCEPTED.reset(accepted)


def _options(cls: type) -> dict[str, Any]:
    """The class's keyword arguments with their signature defaults (`params`, `comm` left out)."""
    return {
        name: p.default for name, p in inspect.signature(cls).parameters.items()
        if name not in _RESERVED and p.default is not inspect.Parameter.empty
    }


def _plain(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Config sequences (YAML lists, OmegaConf ListConfig: betas, bounds) as tuples, as the classes expect."""
    return {k: tuple(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in kwargs.items()}
