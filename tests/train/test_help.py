"""`python -m train --help` lists what a user picks, and stays equal to conf/ as presets are added."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers.config import REPO, compose
from omegaconf import OmegaConf

USER_GROUPS = ("task", "model", "data", "optim", "schedule", "precision")


@pytest.fixture(scope="module")
def help_text() -> str:
    return subprocess.run([sys.executable, "-m", "train", "--help"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout


def _section(text: str, title: str) -> str:
    return text.split(f"== {title}")[1].split("\n\n")[0]


def _presets(group: str) -> set[str]:
    return {path.stem for path in (REPO / "conf" / group).glob("*.yaml")}


def test_help_lists_every_experiment(help_text):
    listed = set(re.findall(r"\b[a-z0-9_]+\b", _section(help_text, "Experiments").split("\n", 2)[2]))
    listed -= {"demos", "recipes"}  # the lists' labels
    assert listed == _presets("experiment")


def test_help_lists_the_user_groups_with_their_options_default_first(help_text):
    lines = dict(re.findall(r"^  (\w+): +(.*(?:\n {13}.*)*)", _section(help_text, "Config groups"), re.MULTILINE))
    assert tuple(lines) == USER_GROUPS  # no schema nodes, no preparation groups, no single-option groups
    defaults = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "config.yaml").defaults)
    chosen = {group: option for entry in defaults if isinstance(entry, dict) for group, option in entry.items()}
    for group, text in lines.items():
        options = [option.strip() for option in text.replace("\n", " ").split(",")]
        assert set(options) == _presets(group), group
        assert options[0] == chosen[group], group


def test_help_keys_exist_in_the_config(help_text):
    keys = re.findall(r"^  ([a-z_.]+) {2,}", _section(help_text, "Keys most often set"), re.MULTILINE)
    assert len(keys) == 10
    cfg = compose()
    missing = object()
    assert [key for key in keys if OmegaConf.select(cfg, key, default=missing) is missing] == []
