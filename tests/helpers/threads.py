"""Tiny-tensor work on one intra-op thread."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run tiny-tensor work on one intra-op thread, restoring the caller's count after.

    A second thread buys nothing at this size, and on a busy 2-core machine spinning OpenMP workers
    made these runs 10x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
