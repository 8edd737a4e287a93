"""Learning-rate schedules: pure functions of the optimizer step that return a multiplier of the peak LR.

`step` is 1-based: the trainer asks for `lr_multiplier(k + 1)` before the update that follows k finished
updates, so the first update uses `step=1`. This matches NVIDIA BERT, whose `PolyWarmUpScheduler.step()`
runs before each optimizer step and sets `last_epoch = <optimizer steps so far> + 1`. Being functions of
the step alone, schedules need no state of their own to resume.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from core.errors import ConfigError
from core.options import InvalidOption, check_kwargs, check_range, require


@dataclass
class ScheduleConfig:
    """Schema of conf/schedule/*.yaml: a schedule's name and its own keyword arguments."""

    name: str = MISSING  # poly_warmup | linear_warmup_cosine | linear_warmup_linear_decay | constant
    kwargs: dict[str, Any] = MISSING


def _check_total_steps(total_steps: int) -> None:
    require(total_steps > 0, "total_steps", total_steps, "must be > 0")


def poly_warmup(step: int, total_steps: int, warmup_fraction: float, degree: float = 0.5) -> float:
    """NVIDIA BERT's `PolyWarmUpScheduler`: linear warm-up, then `(1 - progress) ** degree`.

    With `progress = step / total_steps`: `progress / warmup_fraction` while `progress < warmup_fraction`,
    else `(1 - progress) ** degree`, floored at 0 past the end (NVIDIA's would give NaN there). As in
    NVIDIA's code the decay is of `1 - progress`, not of the fraction of the decay phase left, so the
    multiplier drops at the end of warm-up (phase 1, 7038 steps, warm-up 0.2843: 0.9996 at step 2000,
    0.846 at step 2001), and the last step (`step == total_steps`) has multiplier 0.
    """
    _check_total_steps(total_steps)
    check_range("warmup_fraction", warmup_fraction, 0.0, 1.0)
    require(degree >= 0.0, "degree", degree, "must be >= 0")
    progress = step / total_steps
    if progress < warmup_fraction:
        return progress / warmup_fraction
    return max(1.0 - progress, 0.0) ** degree


def warmup_steps_of(total_steps: int, warmup_steps: int | None = None, warmup_fraction: float | None = None) -> int:
    """A schedule's warm-up in steps, given as a count or as a fraction of the run (rounded); 0 without either."""
    if warmup_steps is not None:
        return int(warmup_steps)
    return round((warmup_fraction or 0.0) * total_steps)


def linear_warmup_cosine(step: int, total_steps: int, warmup_steps: int | None = None, min_ratio: float = 0.0,
                         warmup_fraction: float | None = None) -> float:
    """Linear warm-up to 1 over `warmup_steps`, then cosine decay to `min_ratio` at `total_steps`, held after.

    Warm-up gives `step / warmup_steps`, so the first update has `1 / warmup_steps` and step `warmup_steps`
    is the peak; the cosine runs over steps `warmup_steps .. total_steps`. Give either `warmup_steps` or
    `warmup_fraction` (warm-up steps = round(fraction x total_steps)): epoch-based recipes (Swin: 20 of 300
    epochs) state the warm-up as a share of a run whose length in steps depends on the dataset and batch.
    """
    _check_total_steps(total_steps)
    require((warmup_steps is None) != (warmup_fraction is None), "warmup_steps", warmup_steps,
            f"and warmup_fraction={warmup_fraction}: give exactly one of them")
    if warmup_fraction is not None:
        check_range("warmup_fraction", warmup_fraction, 0.0, 1.0)
    warmup_steps = warmup_steps_of(total_steps, warmup_steps, warmup_fraction)
    require(0 <= warmup_steps <= total_steps, "warmup_steps", warmup_steps,
            f"must be in [0, total_steps={total_steps}]")
    check_range("min_ratio", min_ratio, 0.0, 1.0)
    if step < warmup_steps:
        return step / warmup_steps
    decay_steps = max(total_steps - warmup_steps, 1)  # all warm-up: the peak at its last step, then min_ratio
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def linear_warmup_linear_decay(step: int, total_steps: int, warmup_fraction: float) -> float:
    """BERT's fine-tuning schedule (`warmup_linear` in NVIDIA run_squad / Google BERT).

    Linear warm-up over the first `warmup_fraction` of the steps, then linear decay from the peak to 0 at
    `total_steps`: `(1 - progress) / (1 - warmup_fraction)`, so, unlike `poly_warmup`, it is continuous.
    """
    _check_total_steps(total_steps)
    require(0.0 <= warmup_fraction < 1.0, "warmup_fraction", warmup_fraction, "must be in [0, 1)")
    progress = step / total_steps
    if progress < warmup_fraction:
        return progress / warmup_fraction
    return max((1.0 - progress) / (1.0 - warmup_fraction), 0.0)


def constant(step: int, total_steps: int | None = None) -> float:
    """The peak LR at every step (`total_steps` is accepted, and ignored, like every schedule's)."""
    return 1.0


_SCHEDULES: dict[str, Callable[..., float]] = {
    "poly_warmup": poly_warmup,
    "linear_warmup_cosine": linear_warmup_cosine,
    "linear_warmup_linear_decay": linear_warmup_linear_decay,
    "constant": constant,
}


def build_lr_schedule(name: str, **kwargs: Any) -> Callable[[int], float]:
    """`step -> multiplier` for schedule `name` with its arguments bound; bad names or values raise here."""
    try:
        schedule = _SCHEDULES[name]
    except KeyError:
        known = ", ".join(sorted(_SCHEDULES))
        raise ValueError(f"unknown schedule '{name}'; known schedules: {known}") from None
    arguments = dict(inspect.signature(schedule).parameters)
    del arguments["step"]
    try:
        check_kwargs(schedule, kwargs, owner=f"schedule '{name}'", reserved=("step",))
    except InvalidOption as err:
        if err.key in arguments:  # a value of the wrong kind: the option names itself
            raise
        listed = ", ".join(arguments)
        raise ValueError(f"'{err.key}' is not an argument of schedule '{name}'; arguments: {listed}") from None
    missing = [a for a, p in arguments.items() if p.default is inspect.Parameter.empty and a not in kwargs]
    if missing:
        raise ValueError(f"schedule '{name}' needs argument '{missing[0]}'")
    bound = functools.partial(schedule, **kwargs)
    bound(1)  # the range checks live in the schedule itself: run them once now, not at the first step
    return bound


def check_schedule_config(name: str, kwargs: Mapping[str, Any], total_steps: int) -> None:
    """Compose-time check of `schedule`; errors name the key (`schedule.kwargs.warmup_fraction=1.5 ...`)."""
    try:
        build_lr_schedule(name, total_steps=total_steps, **kwargs)
    except InvalidOption as err:
        raise err.within("schedule.kwargs") from None
    except ValueError as err:
        raise ConfigError(f"schedule.name={name}: {err}") from None
