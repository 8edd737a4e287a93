"""The report's figures, one function per figure, each drawing every run on one Axes.

A new figure is a function `draw(ax, runs)` and a line in `PLOTS`. A run keeps its colour in every figure.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Protocol

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt  # after the backend is chosen
from matplotlib.axes import Axes

from data.atomic import atomic_write


class PlottedRun(Protocol):
    """What a figure reads of a run (`benchmarks.paper.report.Run` is one): the figures import no reader of runs."""

    name: str
    summary: dict[str, Any]  # summary.json's fields

    @property
    def train_records(self) -> list[dict[str, Any]]: ...


def _colour(index: int) -> str:
    return f"C{index % 10}"


def _loss_against(ax: Axes, runs: list[PlottedRun], x_key: str, xlabel: str, *, log_x: bool = False) -> None:
    """Training loss against a record key, one line per run; runs without that key (or, on a log axis, with no
    positive value of it) are left out, and a note says so when none is left."""
    drawn = 0
    for index, run in enumerate(runs):
        points = [(r[x_key], r["loss"]) for r in run.train_records if x_key in r and (r[x_key] > 0 or not log_x)]
        if points:
            xs, losses = zip(*points, strict=True)
            ax.plot(xs, losses, marker=".", color=_colour(index), label=f"{run.name} ({run.summary.get('optimizer')})")
            drawn += 1
    if log_x and drawn:
        ax.set_xscale("log")
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, f"no run logged {x_key}" + (" above 0" if log_x else ""), ha="center",
                transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("training loss")


def loss_vs_step(ax: Axes, runs: list[PlottedRun]) -> None:
    _loss_against(ax, runs, "step", "optimizer step")


def loss_vs_bytes(ax: Axes, runs: list[PlottedRun]) -> None:
    """Single-process runs send nothing: they have no point on the log axis."""
    _loss_against(ax, runs, "comm_bytes_total", "bytes sent per rank since step 0", log_x=True)


def loss_vs_time(ax: Axes, runs: list[PlottedRun]) -> None:
    _loss_against(ax, runs, "elapsed", "training time (s)")


def bits_per_param(ax: Axes, runs: list[PlottedRun]) -> None:
    """One bar per run, named by its optimizer (and its run name where an optimizer has several runs)."""
    shown = [(i, run) for i, run in enumerate(runs) if run.summary.get("bits_per_param_per_step") is not None]
    runs_of = Counter(run.summary.get("optimizer") for _, run in shown)

    def label(run: PlottedRun) -> str:
        optimizer = run.summary.get("optimizer")
        return str(optimizer) if runs_of[optimizer] == 1 else f"{optimizer}\n{run.name}"

    bits = [run.summary["bits_per_param_per_step"] for _, run in shown]
    ax.bar(range(len(shown)), bits, color=[_colour(i) for i, _ in shown], tick_label=[label(r) for _, r in shown])
    for x, value in enumerate(bits):
        ax.annotate(f"{value:.3g}", (x, value), ha="center", va="bottom", fontsize="small")
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
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax, runs)
        ax.set_title(name.removesuffix(".png").replace("_", " "))
        fig.tight_layout()
        path = Path(out_dir) / name
        atomic_write(path, lambda handle, fig=fig: fig.savefig(handle, format="png", dpi=120))
        plt.close(fig)
        paths.append(path)
    return paths


def write_scaling_plot(rows: list[dict], path: Path) -> Path:
    """`benchmarks.paper.scaling`'s rows as one panel per model: scaling efficiency against GPUs, a line per
    optimizer."""
    models = list(dict.fromkeys(row["model"] for row in rows))
    optimizers = list(dict.fromkeys(row["optimizer"] for row in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.5), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models, strict=True):
        for index, optimizer in enumerate(optimizers):
            points = [(r["gpus"], 100 * r["efficiency"]) for r in rows
                      if r["model"] == model and r["optimizer"] == optimizer]
            ax.plot(*zip(*points, strict=True), marker=".", color=_colour(index), label=optimizer)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} ({rows[0]['network']})")
        ax.set_xlabel("GPUs")
    axes[0][0].set_ylabel("scaling efficiency (%)")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=120))
    plt.close(fig)
    return path
