"""Shared fixtures (the helpers they build on are in helpers/), and the cores shared between pytest's workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.config import compose, swin_digits_overrides

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
if not Path("/dev/nvidiactl").exists():
    # No GPU: Triton's kernels (LAMB's `triton=True`) run in its interpreter on host tensors. Triton reads this when
    # it is imported, so it is set here, before any test imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


@pytest.fixture(scope="module")
def tokenizer():
    """The vendored BERT vocabulary's tokenizer."""
    from data.text.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits demo as an ImageFolder."""
    from data.images.digits import write_digits_imagefolder

    return write_digits_imagefolder(tmp_path_factory.mktemp("data") / "digits")


@pytest.fixture(scope="module")
def swin_digits_run(digits: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step Swin digits run that evaluates (and keeps the best checkpoint) every 2 steps."""
    from train.run import run

    run_dir = tmp_path_factory.mktemp("runs") / "swin"
    run(compose(swin_digits_overrides(digits, run_dir)), run_dir)
    return run_dir


@pytest.fixture
def fresh_compiles():
    """torch.compile's caches and counters emptied before and after the test: it compiles its own graphs and counts
    them from zero."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
