"""Shared fixtures: the real config tree, composed and shrunk to test scale."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_configure(config: pytest.Config) -> None:
    """Share the cores between pytest-xdist's workers as the local launcher shares them between its workers:
    each worker's torch taking every core made the suite about 20 % slower, and some tests 2x slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from train.distributed import local_worker_threads, visible_cores

        threads = local_worker_threads(workers, os.environ, visible_cores())
        if threads is not None:  # else the OMP_NUM_THREADS the user set
            os.environ["OMP_NUM_THREADS"] = str(threads)  # processes a test starts inherit the share
            torch.set_num_threads(threads)

REPO = Path(__file__).resolve().parents[1]

# A model and batch small enough for ~10 ms steps, on the real config tree.
TINY = [
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "data.max_seq_len=32",
    "data.max_predictions=5",
    "data.dupe_factor=1",
    "data.heldout_sequences=0",  # no evaluation: the records are the training series (evaluation tests ask for one)
    "trainer.max_steps=6",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "trainer.log_every=1",
    "trainer.checkpoint_every=2",
    "trainer.device=cpu",
    "logger.progress_bar=false",
    "logger.tensorboard=false",
    "logger.wandb=disabled",
]


def compose(overrides: list[str] | None = None):
    """The config `python -m train <overrides>` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from train.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    return [*TINY, f"hydra.run.dir={tmp_path / 'run'}"]


def run_train(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m train <args>` in a subprocess, from the repository root."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout, **kwargs,
    )


def optim_preset(name: str) -> dict:
    """conf/optim/<name>.yaml as `build_optimizer` takes it: its keys but `name` (PyYAML is stricter than OmegaConf:
    `6e-3` would be a string, so the presets write `6.0e-3`)."""
    import yaml

    cfg = yaml.safe_load((REPO / "conf" / "optim" / f"{name}.yaml").read_text())
    cfg.pop("name")
    return cfg


def runnable_optimizers() -> list[str]:
    """Every registered optimizer this machine can build: NVIDIA apex's need apex and a GPU (elsewhere their
    one-line refusal is what is tested)."""
    from core.apex import missing_nvidia_apex
    from optim import list_optimizers
    from optim.apex import APEX_OPTIMIZERS

    apex_missing = missing_nvidia_apex("apex.optimizers", "amp_C") is not None
    return [name for name in list_optimizers() if not (apex_missing and name in APEX_OPTIMIZERS)]
