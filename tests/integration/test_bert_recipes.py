"""The BERT-Large presets are one recipe: docs/workloads/bert.md's table holds every preset's values, and each row is
what the preset composes to; every optimizer shares the batch, schedule, warm-up and phase-2 start of its phase."""

from __future__ import annotations

import pytest
from helpers.config import REPO, compose
from omegaconf import OmegaConf

from train.config import validate

PAGE = REPO / "docs" / "workloads" / "bert.md"
PRESETS = sorted(path.stem for path in (REPO / "conf" / "experiment").glob("bert_large_phase*.yaml"))
COLUMNS = ("experiment", "optim", "batch", "lr", "warm-up", "steps", "payload", "settings", "source")


def recipe_table() -> dict[str, dict[str, str]]:
    """The rows of the page's "One recipe for every optimizer" table, by experiment."""
    section = PAGE.read_text().split("### One recipe for every optimizer", 1)[1]
    lines = [line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("| `")]
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        row = dict(zip(COLUMNS, cells, strict=True))
        rows[row["experiment"].strip("`")] = row
    return rows


def _settings(cell: str) -> dict[str, str]:
    """`key=value` pairs of a cell (backquoted, comma-separated)."""
    pairs = [part.strip().strip("`") for part in cell.split(",") if "=" in part]
    return dict(pair.split("=", 1) for pair in pairs)


def test_the_table_lists_every_bert_large_preset_but_squad():
    assert sorted(recipe_table()) == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_is_its_row(name: str):
    row = recipe_table()[name]
    cfg = compose([f"experiment={name}", "trainer.device=cpu", "data.path=/unused"])
    assert cfg.optim.name == row["optim"]
    assert cfg.trainer.global_batch_size == int(row["batch"])
    assert cfg.optim.lr == pytest.approx(float(row["lr"]))
    assert cfg.schedule.name == "poly_warmup" and cfg.schedule.kwargs.warmup_fraction == float(row["warm-up"])
    assert cfg.trainer.max_steps == int(row["steps"])
    wire = _settings(row["payload"]) or {"trainer.grad_allreduce_dtype": "fp32"}  # "fp32 (no option)"
    for key, value in {**wire, **_settings(row["settings"])}.items():
        assert str(OmegaConf.select(cfg, key)) == value, key
    assert cfg.trainer.init_optimizer_state is False  # phase 2: phase 1's weights, fresh moments, for every optimizer
    validate(cfg)  # a 16-bit DDP all-reduce only where DDP runs


def test_every_optimizer_shares_its_phase_batch_schedule_and_start():
    rows = recipe_table()
    for phase in ("phase1", "phase2"):
        shared = {(row["batch"], row["warm-up"], row["steps"]) for name, row in rows.items() if phase in name}
        assert len(shared) == 1, phase
        names = [name for name in PRESETS if phase in name]
        configs = [compose([f"experiment={name}"]) for name in names]
        for key in ("trainer.seed", "trainer.grad_clip", "optim.weight_decay", "schedule", "data.max_seq_len"):
            values = {str(OmegaConf.select(cfg, key)) for cfg in configs}
            assert len(values) == 1, (phase, key, values)
