"""Run a function on N gloo ranks in spawned processes and collect each rank's return value."""

from __future__ import annotations

import io
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, results: Any, backend: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    # The variable alone comes too late: torch is imported (its thread pool sized) before this runs. The ranks share
    # the machine's cores, and their tensors are tiny: one intra-op thread each, as the subprocess launches get.
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # Serialised to bytes: tensors put on the queue directly would travel as shared-memory handles
        # that die with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        results.put((rank, buffer.getvalue(), None))
    except Exception:  # reported to the parent, which fails the test with the trace
        results.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> list[Any]:
    """`fn(rank, world_size, *args)` on every rank (a module-level function); results in rank order.

    `backend="nccl"` puts rank r on GPU r (NCCL refuses two ranks on one GPU); gloo also carries CUDA tensors.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, fn, args, results, backend))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        collected = [results.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    errors = [err for _, _, err in collected if err]
    if errors:
        raise AssertionError("a rank failed:\n" + errors[0])
    ordered = sorted(collected, key=lambda item: item[0])
    return [torch.load(io.BytesIO(value), weights_only=False) for _, value, _ in ordered]
