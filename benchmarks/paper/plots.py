"""The report's figures, one function per figure, each drawing every run on one Axes; the studies' figures, drawn
from `Line`s (the convergence study's) or rows (the scaling model's).

A new report figure is a function `draw(ax, runs)` and a line in `PLOTS`. A run keeps its colour in every figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.axes import Axes

from core.atomic import atomic_write


class PlottedRun(Protocol):
    """What a figure reads of a run (`benchmarks.paper.report.Run` is one): the figures import no reader of runs."""

    name: str
    summary: dict[str, Any]  # summary.json's fields

    @property
    def train_records(self) -> list[dict[str, Any]]: ...


# A loss this far above the highest starting loss among the runs is a divergence, not training: the axis is cut
# there, so one spike does not flatten every other curve into one line.
_DIVERGED_ABOVE_START = 1.25


def _colour(index: int) -> str:
    return f"C{index % 10}"


def _label(run: PlottedRun) -> str:
    """One legend entry per run: its name, with its optimizer when the name does not already say it."""
    optimizer = run.summary.get("optimizer")
    return run.name if not optimizer or str(optimizer) in run.name else f"{run.name} ({optimizer})"


def _note(ax: Axes, lines: list[str]) -> None:
    """What the reader must know about what is (not) drawn, written on the figure under the axes."""
    if lines:
        ax.text(0.0, -0.16, "\n".join(lines), transform=ax.transAxes, va="top", fontsize="small", wrap=True)


def _loss_against(ax: Axes, runs: list[PlottedRun], x_key: str, xlabel: str, *, log_x: bool = False) -> None:
    """Training loss against a record key, one line per run. Losses above the cut (`_DIVERGED_ABOVE_START`) are
    drawn on the top edge as triangles; runs without the key, or on a log axis with no positive value of it (runs
    that sent nothing), are named under the axes instead of being silently left out."""
    series, missing = [], []
    for index, run in enumerate(runs):
        points = [(r[x_key], r["loss"]) for r in run.train_records if x_key in r and (r[x_key] > 0 or not log_x)]
        if points:
            series.append((index, run, *zip(*points, strict=True)))
        elif run.train_records:
            missing.append(_label(run))
    starts = [losses[0] for *_, losses in series]
    cut = _DIVERGED_ABOVE_START * max(starts) if starts else None
    notes = []
    for index, run, xs, losses in series:
        peak = max(losses)
        diverged = cut is not None and peak > cut
        shown = [min(loss, cut) for loss in losses] if diverged else list(losses)
        label = _label(run) + (f" (peaks at {peak:.3g})" if diverged else "")
        ax.plot(xs, shown, marker=".", color=_colour(index), label=label)
        if diverged:
            above = [x for x, loss in zip(xs, losses, strict=True) if loss > cut]
            ax.plot(above, [cut] * len(above), linestyle="none", marker="^", markersize=8, color=_colour(index),
                    clip_on=False)
            notes.append(f"loss axis cut at {cut:.3g} ({_DIVERGED_ABOVE_START}x the highest starting loss): "
                         "\u25b2 marks losses above it")
    if log_x and series:
        ax.set_xscale("log")
    if series:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if missing:
        why = "sent nothing (one rank), so they have no point on the log axis" if log_x else f"logged no {x_key}"
        if series:
            notes.append(f"not drawn: {', '.join(missing)}: {why}")
        else:
            ax.text(0.5, 0.5, f"{', '.join(missing)}\n{why}", ha="center", va="center", transform=ax.transAxes,
                    wrap=True)
            ax.set_xticks([])
            ax.set_yticks([])  # an empty frame's 0..1 ticks would read as data
    _note(ax, list(dict.fromkeys(notes)))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss")


def loss_vs_step(ax: Axes, runs: list[PlottedRun]) -> None:
    _loss_against(ax, runs, "step", "optimizer step")


def loss_vs_bytes(ax: Axes, runs: list[PlottedRun]) -> None:
    _loss_against(ax, runs, "comm_bytes_total", "bytes sent per rank since step 0", log_x=True)


def loss_vs_time(ax: Axes, runs: list[PlottedRun]) -> None:
    _loss_against(ax, runs, "elapsed", "training time (s)")


def bits_per_param(ax: Axes, runs: list[PlottedRun]) -> None:
    """One bar per run, named as in the legends, on an axis from 0; a run that sent nothing is labelled so."""
    shown = [(i, run) for i, run in enumerate(runs) if run.summary.get("bits_per_param_per_step") is not None]
    bits = [run.summary["bits_per_param_per_step"] for _, run in shown]
    ax.bar(range(len(shown)), bits, color=[_colour(i) for i, _ in shown])
    ax.set_xticks(range(len(shown)), [_label(run) for _, run in shown], rotation=30, ha="right",
                  rotation_mode="anchor")
    for x, value in enumerate(bits):
        ax.annotate(f"{value:.3g}" if value else "0: sent nothing", (x, value), ha="center", va="bottom",
                    fontsize="small")
    ax.set_ylim(0, 1.15 * max(bits) if any(bits) else 1.0)  # all zero: still an axis from 0, not around it
    ax.set_ylabel("bits per parameter per step")


PLOTS = {
    "loss_vs_step.png": loss_vs_step,
    "loss_vs_bytes.png": loss_vs_bytes,
    "bits_per_param.png": bits_per_param,
    "loss_vs_time.png": loss_vs_time,
}


def write_plots(runs: list[PlottedRun], out_dir: Path) -> list[Path]:
    """Every figure of `PLOTS` as a PNG in `out_dir`, written atomically; returns their paths."""
    paths = []
    for name, draw in PLOTS.items():
        fig, ax = plt.subplots(figsize=(max(7.0, 0.7 * len(runs) + 2), 4.5))
        draw(ax, runs)
        ax.set_title(name.removesuffix(".png").replace("_", " "))
        paths.append(save_figure(fig, Path(out_dir) / name))
    return paths


def save_figure(fig: plt.Figure, path: Path) -> Path:
    """`fig` as a PNG at `path`, written atomically, then closed."""
    # bbox "tight": the legend beside the axes and the notes under them are part of the figure.
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return path


_MARKERS = "os^vDPX*h<"  # with the line styles, every optimizer its own look where colours repeat or lines meet
_LINE_STYLES = ("-", "--", "-.", ":")
_SAME_LINE = 0.01  # of a panel's height: curves closer than this everywhere would be drawn over each other


def write_scaling_plot(rows: list[dict], path: Path) -> Path:
    """`benchmarks.paper.scaling`'s rows as one panel per model: scaling efficiency against GPUs, a line per
    optimizer. Optimizers whose curves lie within `_SAME_LINE` of the panel's height of each other (the DDP ones send
    the same gradients) share one line named after all of them, so no curve hides behind another; each panel has its
    own y range and legend."""
    models = list(dict.fromkeys(row["model"] for row in rows))
    optimizers = list(dict.fromkeys(row["optimizer"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        panel = [100 * r["efficiency"] for r in rows if r["model"] == model]
        tolerance = _SAME_LINE * (max(panel) - min(panel))
        lines: list[tuple[list[tuple[int, float]], list[str]]] = []  # (points, the optimizers drawn by them)
        for optimizer in optimizers:
            points = [(r["gpus"], 100 * r["efficiency"]) for r in rows
                      if r["model"] == model and r["optimizer"] == optimizer]
            same = next((names for drawn, names in lines if _same_line(drawn, points, tolerance)), None)
            if same is None:
                lines.append((points, [optimizer]))
            else:
                same.append(optimizer)
        for points, names in lines:
            index = optimizers.index(names[0])
            ax.plot(*zip(*points, strict=True), marker=_MARKERS[index % len(_MARKERS)], markersize=5,
                    linestyle=_LINE_STYLES[index % len(_LINE_STYLES)], color=_colour(index), label=" = ".join(names))
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} ({rows[0]['network']})")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("scaling efficiency (%)")
        ax.legend(fontsize="x-small", loc="lower left")
    fig.text(0.5, 0.0, f"a = b: optimizers within {_SAME_LINE:.0%} of the panel's height of each other at every GPU "
             "count, drawn as one line", ha="center", va="bottom", fontsize="small")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=120))
    plt.close(fig)
    return path


def _same_line(drawn: list[tuple[int, float]], points: list[tuple[int, float]], tolerance: float) -> bool:
    """Whether two efficiency curves would be drawn over each other (same GPU counts, within `tolerance`)."""
    return len(drawn) == len(points) and all(
        g == h and abs(a - b) <= tolerance for (g, a), (h, b) in zip(drawn, points, strict=True))


@dataclass(frozen=True)
class Line:
    """One curve of a study figure: a mean, optionally the range it is the mean of (shaded) and single values
    (each seed's) as dots."""

    label: str
    xs: list[float]
    ys: list[float]
    low: list[float] | None = None
    high: list[float] | None = None
    dots: list[tuple[float, float]] = field(default_factory=list)


def _style(index: int) -> dict[str, Any]:
    """A look per line that no other of the first 40 shares: colour, line style and marker together."""
    return {"color": _colour(index), "linestyle": _LINE_STYLES[index // 10 % len(_LINE_STYLES)],
            "marker": _MARKERS[index % len(_MARKERS)], "markersize": 4}


def write_lines(lines: list[Line], path: Path, xlabel: str, ylabel: str, title: str, *, log_x: bool = False) -> Path:
    """Every line on one Axes, each in its own style, the legend beside it."""
    fig, ax = plt.subplots(figsize=(9.0, 5.0))
    for index, line in enumerate(lines):
        style = _style(index)
        ax.plot(line.xs, line.ys, label=line.label, **style)
        if line.low is not None and line.high is not None:
            ax.fill_between(line.xs, line.low, line.high, color=style["color"], alpha=0.12)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, path)


def write_panels(lines: list[Line], path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """One small panel per line, each on its own y scale with 0 marked, so that a gap of a few hundredths is as
    visible as one of a whole unit; each line's dots (its seeds) beside its mean."""
    columns = min(5, len(lines))
    rows = -(-len(lines) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.4 * rows), squeeze=False, sharex=True)
    for index, (ax, line) in enumerate(zip(axes.flat, lines, strict=False)):
        style = _style(index)
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.plot(line.xs, line.ys, **style)
        if line.dots:
            ax.plot(*zip(*line.dots, strict=True), linestyle="none", marker=".", color=style["color"], alpha=0.5)
        ax.set_title(line.label, fontsize="small")
        ax.tick_params(labelsize="x-small")
    for ax in axes.flat[len(lines):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel(xlabel, fontsize="small")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    return save_figure(fig, path)
