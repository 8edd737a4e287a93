"""The communication layer: byte counts, the single-process identity, and the DDP hook against plain DDP."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.distributed_harness import run_on_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from optim.comm import Comm, average_tensors_
from train.allreduce_hook import AllReduceHookState, counting_allreduce_hook


def test_single_process_is_identity_and_counts_nothing():
    comm = Comm()
    tensor = torch.arange(4.0)
    comm.all_reduce(tensor)
    comm.broadcast(tensor)
    assert comm.all_reduce(tensor, async_op=True).wait()
    assert torch.equal(tensor, torch.arange(4.0))
    assert comm.any(True) and not comm.any(False)
    assert comm.any_later(True).result() and not comm.any_later(False).result()
    assert comm.take_counts() == {"bytes": 0, "control_bytes": 0, "collectives": 0}


def _collectives(rank, world_size):
    comm = Comm()
    x = torch.full((10,), float(rank + 1))
    comm.all_reduce(x)
    y = torch.ones(6, dtype=torch.float16)
    average_tensors_([y], comm, wire_dtype=torch.float16)
    evaluated = [torch.full((5,), float(rank)), torch.full((2, 2), float(rank), dtype=torch.bfloat16)]
    average_tensors_(evaluated, comm, counted=False)  # an evaluation's average: not the step's traffic
    z = torch.zeros(3)
    if rank == 0:
        z += 7
    comm.broadcast(z)
    out = torch.empty(world_size * 2)
    comm.all_gather_into_tensor(out, torch.full((2,), float(rank)))
    stop = comm.any(rank == world_size - 1)
    votes = [comm.any_later(rank == world_size - 1), comm.any_later(False)]  # posted together, read later
    stop_later, no_stop = (vote.result() for vote in votes)
    averaged = y.tolist() + [t.tolist() for t in evaluated]
    return x.tolist(), averaged, z.tolist(), out.tolist(), (stop, stop_later, no_stop), comm.take_counts()


def _collectives_and_all_to_all(rank, world_size):
    """Both multi-rank workers in one spawn (each spawn costs seconds of imports); each with its own Comm."""
    return _collectives(rank, world_size), _all_to_all(rank, world_size)


@functools.cache
def _ranks(world_size: int) -> list[tuple]:
    """rank -> (collectives results, all-to-all results), from one multi-process run per world size."""
    return run_on_ranks(_collectives_and_all_to_all, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_and_byte_counts(world_size):
    results = [collectives for collectives, _ in _ranks(world_size)]
    total = sum(range(1, world_size + 1))
    for rank, (x, y, z, gathered, stop, counts) in enumerate(results):
        assert x == [float(total)] * 10
        mean = (world_size - 1) / 2
        assert y == [1.0] * 6 + [[mean] * 5, [[mean] * 2] * 2]  # uncounted: not in the bytes below
        assert z == [7.0] * 3
        assert gathered == [float(r) for r in range(world_size) for _ in range(2)]
        assert stop == (True, True, False)
        broadcast_bytes = 3 * 4 if rank == 0 else 0
        assert counts["bytes"] == 10 * 4 + 6 * 2 + broadcast_bytes + 2 * 4
        assert counts["control_bytes"] == 3 * 4
        assert counts["collectives"] == (4 if rank == 0 else 3)


def _ddp_grads(rank, world_size, wire_dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    comm = Comm()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005)  # several buckets
    if wire_dtype is not None:
        ddp.register_comm_hook(AllReduceHookState(comm, wire_dtype), counting_allreduce_hook)
    g = torch.Generator().manual_seed(100 + rank)
    ddp(torch.randn(5, 8, generator=g)).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()], comm.take_counts()["bytes"]


WIRE_DTYPES = [None, "fp32", "fp16", "bf16"]


def _ddp_grads_per_wire_dtype(rank, world_size):
    """Plain DDP and the hook in every wire dtype, in one spawn: a fresh model, DDP and Comm for each."""
    return {wire_dtype: _ddp_grads(rank, world_size, wire_dtype) for wire_dtype in WIRE_DTYPES}


def test_counting_hook_matches_plain_ddp_and_halves_the_bytes_in_fp16_and_bf16():
    ranks = run_on_ranks(_ddp_grads_per_wire_dtype, 2)
    plain = [r[None] for r in ranks]
    numel = 8 * 16 + 16 + 16 * 3 + 3
    for wire_dtype, element_size, tolerance in [("fp32", 4, 0.0), ("fp16", 2, 1e-3), ("bf16", 2, 1e-2)]:
        hooked = [r[wire_dtype] for r in ranks]
        for (plain_grads, plain_bytes), (hooked_grads, hooked_bytes) in zip(plain, hooked, strict=True):
            for a, b in zip(plain_grads, hooked_grads, strict=True):
                torch.testing.assert_close(b, a, rtol=tolerance, atol=tolerance)  # fp32: bit for bit
                assert b.dtype == torch.float32
            assert plain_bytes == 0
            assert hooked_bytes == numel * element_size  # every gradient element once, in the wire dtype
        torch.testing.assert_close(hooked[0][0][0], hooked[1][0][0], rtol=0, atol=0)  # replicas agree exactly


def _all_to_all(rank, world_size):
    comm = Comm()
    send = torch.tensor([[10 * rank + j, 10 * rank + j] for j in range(world_size)], dtype=torch.uint8)
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send)
    return received, comm.take_counts()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_single_routes_chunks_and_counts_the_input(world_size):
    for rank, (received, counts) in enumerate(all_to_all for _, all_to_all in _ranks(world_size)):
        assert received.tolist() == [[10 * i + rank] * 2 for i in range(world_size)]  # chunk i from rank i
        assert counts == {"bytes": 2 * world_size, "control_bytes": 0, "collectives": 1}


def test_all_to_all_single_on_one_process_is_a_copy():
    comm = Comm()
    out = torch.empty(3)
    comm.all_to_all_single(out, torch.arange(3.0))
    assert out.tolist() == [0.0, 1.0, 2.0] and comm.take_counts()["bytes"] == 0


def _kinds_and_simulated_delay(rank, world_size):
    """Counts by kind; then the same all-reduce with and without a simulated 10 GbE network, timed."""
    import time

    from optim.network import parse_cluster

    comm = Comm()
    comm.all_reduce(torch.ones(10))
    comm.broadcast(torch.ones(3))
    comm.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2))
    comm.all_to_all_single(torch.empty(world_size, dtype=torch.uint8), torch.ones(world_size, dtype=torch.uint8))
    kinds = comm.take_counts(by_kind=True)
    timed = {}
    for name, network in (("plain", None), ("10gbe", parse_cluster("10gbe"))):
        comm = Comm(network=network)
        tensor = torch.ones(1 << 20)  # 4 MiB
        comm.barrier()
        start = time.perf_counter()
        comm.all_reduce(tensor)
        comm.all_reduce(tensor, async_op=True).wait()
        comm.all_reduce(tensor, async_op=True).get_future().wait()  # the DDP hook's way
        timed[name] = time.perf_counter() - start, tensor[0].item(), comm.take_counts(by_kind=True)
    return kinds, timed


def test_counts_by_kind_and_a_simulated_network_delays_without_changing_counts():
    from optim.network import collective_seconds, parse_cluster

    ranks = run_on_ranks(_kinds_and_simulated_delay, 2)
    modelled = 3 * collective_seconds("all_reduce", 4 << 20, 2, parse_cluster("10gbe"))
    assert modelled == pytest.approx(3 * (4 << 20) / 1.25e9 + 3 * 2 * 14e-6)  # 2 * 1/2 * n / B + 2 alpha each
    for rank, (kinds, timed) in enumerate(ranks):
        assert kinds["by_kind"] == {"all_reduce": {"collectives": 1, "bytes": 40},
                                    "broadcast": {"collectives": int(rank == 0), "bytes": 12 * (rank == 0)},
                                    "all_gather": {"collectives": 1, "bytes": 8},
                                    "all_to_all": {"collectives": 1, "bytes": 2}}
        assert kinds["bytes"] == sum(k["bytes"] for k in kinds["by_kind"].values())
        (_, plain_value, plain_counts), (seconds, value, counts) = timed["plain"], timed["10gbe"]
        assert seconds >= modelled  # three back-to-back collectives on one simulated link
        assert value == plain_value == 8.0 and counts == plain_counts  # same data, same counts
        assert counts["by_kind"]["all_reduce"] == {"collectives": 3, "bytes": 3 * (4 << 20)}
