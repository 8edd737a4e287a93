"""`summary.json`: one record of what a run did (config, final and best metrics, data sent, speed), for reports.

Rank 0 writes it at the end of every run, a run stopped early included (`"finished": false`, and `"stopped"` says
by what: a signal, a non-finite loss, a full disk); `python -m
benchmarks.paper.report` turns summaries into tables and plots, and rebuilds what it can of one from `metrics.jsonl`
and the recorded config for a run that has none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch
from omegaconf import OmegaConf

from core.atomic import atomic_write_json
from train.metrics import RunTotals, log_line
from train.run_dir import RunDir
from train.stop import writing

_STAMPS = ("step", "time", "elapsed")  # what every record carries besides its metrics
VALIDATION_LOSS = "eval/loss"  # the held-out loss, where a task's evaluation reports one (BERT, image classification)


def higher_is_better(key: str) -> bool | None:
    """Which end of a metric is its best, decided by name: losses (any name holding `loss`) lowest; accuracies
    (`top1`, `top5`, `accuracy`, `span_accuracy`, ...), `f1` and `exact_match` highest; None for the rest, which
    are not scores (SQuAD's question count, the image eval's resize and crop). An `ema_` prefix is ignored."""
    name = key.rsplit("/", 1)[-1].removeprefix("ema_")
    if "loss" in name:
        return False
    if name.startswith("top") or "acc" in name or name in ("f1", "exact_match"):
        return True
    return None


def final_values(records: list[dict[str, Any]]) -> dict[str, float]:
    """The last logged value of every metric (an eval metric's from the last evaluation)."""
    return {key: value for record in records for key, value in record.items() if key not in _STAMPS}


def best_values(records: list[dict[str, Any]]) -> dict[str, float]:
    """For each eval/* score, its best logged value (see `higher_is_better`)."""
    best: dict[str, float] = {}
    for record in records:
        for key, value in record.items():
            higher = higher_is_better(key) if key.startswith("eval/") else None
            if higher is None:
                continue
            if key not in best or (value > best[key] if higher else value < best[key]):
                best[key] = value
    return best


def config_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The summary's fields that the run's config record alone answers (a plan's `config`, or a recorded one)."""
    config = OmegaConf.to_container(OmegaConf.create(config), resolve=True, enum_to_str=True)
    options = config["optim"]
    return {
        "task": config["task"]["name"],
        "model": config["model"]["name"],
        "optimizer": options.pop("name"),
        "optimizer_options": options,
        "precision": str(config["precision"]["dtype"]),
        # Set when collectives take a modelled network's time instead of the real one's; null for real runs.
        "simulated_network": config["trainer"].get("simulated_network"),  # absent from records of older runs
    }


def build_summary(
    config: Mapping[str, Any],
    records: list[dict[str, Any]],
    totals: RunTotals,
    *,
    steps: int,
    max_steps: int,
    world_size: int,
    global_batch_size: int,
    num_params: int,
    device: torch.device,
    samples_unit: str,
    elapsed_seconds: float,
    stopped: str | None = None,
) -> dict[str, Any]:
    """The whole summary of a run that has done `steps` of `max_steps`; `config` is its record, `records` its
    metrics.jsonl; `stopped` says what stopped it early (a signal's name, an error's line)."""
    final = final_values(records)
    return {
        **config_fields(config),
        "world_size": world_size,
        "global_batch_size": global_batch_size,
        "steps": steps,
        "max_steps": max_steps,
        "finished": steps >= max_steps,
        "stopped": stopped,
        "num_params": num_params,
        "final": final,
        "best": best_values(records),
        # The last evaluation's loss on held-out data (BERT: MLM + NSP, the paper's "BERT validation loss").
        "validation_loss": final.get(VALIDATION_LOSS),
        "bits_per_param_per_step": 8 * totals.bytes / steps / num_params if steps else None,
        "bytes_total": totals.bytes,
        # Outside the steps: averaging drifted replicas (SLAMB, SlowMo, 0/1 Adam between syncs) to evaluate and
        # export them, on its own line; a run whose replicas always agree sends none.
        "replica_average_bits_per_param_per_step": (8 * totals.replica_average_bytes / steps / num_params
                                                    if steps else None),
        "replica_average_bytes_total": totals.replica_average_bytes,
        "collectives_per_step": totals.collectives / steps if steps else None,
        "mean_step_seconds": totals.seconds / steps if steps else None,
        "samples_per_second": totals.samples / totals.seconds if totals.seconds else None,
        "samples_unit": samples_unit,
        "elapsed_seconds": elapsed_seconds,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch_version": torch.__version__,
    }


def write_summary(run_dir: RunDir, summary: dict[str, Any]) -> None:
    with writing(run_dir.summary_file):
        atomic_write_json(run_dir.summary_file, summary, indent=2)


def record_stop(run_dir: RunDir, reason: str) -> None:
    """Record why a run stopped where its rank 0 could not know it (another worker died): in train.log and as
    summary.json's `stopped`; the summary rank 0 wrote keeps its figures, and a rank 0 that died too leaves the
    config's fields only."""
    with writing(run_dir.log_file), open(run_dir.log_file, "a") as log:
        log.write(log_line(f"stopped: {reason}"))
    try:
        summary = json.loads(run_dir.summary_file.read_text())
    except (OSError, ValueError):  # none, or cut
        recorded = run_dir.recorded_config()
        summary = config_fields(recorded) if recorded is not None else {}
    write_summary(run_dir, {**summary, "finished": False, "stopped": reason})
