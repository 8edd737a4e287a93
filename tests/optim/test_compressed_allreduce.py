"""The 1-bit compressed all-reduce: packing, padding, the equivalence spec on 2-4 gloo ranks, bytes, convergence."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from helpers.distributed_harness import run_on_ranks

from optim import compressed
from optim._math import FOREACH_CHUNK_NUMEL
from optim.comm import Comm, average_tensors_
from optim.compressed import (
    CompressedBuckets,
    _decode_into,
    _decode_sum_into_,
    bucket_layout,
    compress_,
    compressed_allreduce_,
    compressed_bytes_per_call,
    pack_signs,
    padded_numel,
    unpack_signs,
    zero_codes_,
)
from optim.flat import FlatLayout, FlatState
from optim.mirror_comm import MirrorComm


def test_packing_is_msb_first_like_numpy_and_round_trips():
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert packed.tolist() == np.packbits((x >= 0).numpy()).tolist()
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    assert pack_signs(torch.tensor([1.0, -1, -1, -1, -1, -1, -1, -1])).item() == 128  # element 0 is the MSB


def test_both_zeros_count_as_plus_one():
    x = torch.tensor([0.0, -0.0, -1.0, -1.0, -1.0, -1.0, -1.0, 2.0])
    error = torch.zeros(8)
    z = x + error  # what the all-reduce compresses: adding the +0-initialised error turns -0.0 into +0.0
    scale = compress_(z, error)
    signs = unpack_signs(pack_signs(z))
    assert signs.tolist() == [1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0]
    assert torch.equal(error, z - scale * signs)


@pytest.mark.parametrize("looked_up_on_the_cpu", [True, False])
@pytest.mark.parametrize("block", [8, 64, None])
def test_decoding_is_the_table_look_up_bit_for_bit(monkeypatch, block, looked_up_on_the_cpu):
    """The decoders look the signs up in a table times the scale (a CPU) or compute `+-scale` from the unpacked bits
    (a GPU, where a table look-up's gather crawls): either way the values of `unpack_signs` times each row's scale,
    signed zeros included, for any scale, in blocks or whole; a zeroed element +0.0; and the server's weighted sum
    that of the looked-up rows, in rank order."""
    if block is not None:
        monkeypatch.setitem(FOREACH_CHUNK_NUMEL, "cpu", block)
    if not looked_up_on_the_cpu:
        monkeypatch.setattr(compressed, "TABLE_DECODING_DEVICES", frozenset())
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.tensor([[0.75], [-1.5], [0.0], [-0.0]])
    looked_up = torch.stack([unpack_signs(row) for row in packed])
    out = torch.full((4, 128), float("nan"))
    _decode_into(out, packed, scales)
    expected = looked_up * scales
    assert torch.equal(out, expected) and torch.equal(torch.signbit(out), torch.signbit(expected))

    flags = torch.rand(4 * 128, generator=generator) < 0.3
    _decode_into(out, packed, scales, zero_codes_(flags.clone()))
    expected = expected.masked_fill(flags.view(4, 128), 0.0)
    assert torch.equal(out, expected) and not torch.signbit(out[flags.view(4, 128)]).any()

    weights = torch.tensor([[0.3], [-1.7], [2.5], [0.1]])
    total = torch.empty(128)
    _decode_sum_into_(total, packed, weights)
    assert torch.equal(total, (looked_up * weights).sum(0))


@pytest.mark.parametrize(("numel", "world_size", "padded"), [(1000, 2, 1008), (1000, 3, 1008), (1000, 4, 1024),
                                                             (1024, 4, 1024), (1, 1, 8), (0, 2, 0), (17, 8, 64)])
def test_padding_as_deepspeed(numel, world_size, padded):
    assert padded_numel(numel, world_size) == padded
    assert padded % world_size == 0 and (padded // world_size) % 8 == 0


def test_layouts():
    assert bucket_layout([2, 1], "per_tensor") == [[0], [1], [2]]
    assert bucket_layout([2, 0, 1], "per_group") == [[0, 1], [2]]
    assert bucket_layout([2, 1], "flat_scaled") == [[0, 1, 2]]
    with pytest.raises(ValueError, match="bucketing='fused'"):
        bucket_layout([1], "fused")


def test_one_process_is_the_identity():
    comm = Comm()
    x = torch.randn(16)
    out = compressed_allreduce_(x.clone(), torch.zeros(16), torch.zeros(16), comm)
    assert torch.equal(out, x) and comm.take_counts()["bytes"] == 0 and compressed_bytes_per_call(1000, 1) == 0


@pytest.mark.parametrize("divisor", [None, 3.0, -0.5])
@pytest.mark.parametrize("fed_back", [False, True])
def test_zeroed_and_divided_in_the_decoding_as_after_it(divisor, fed_back):
    """Zero codes and a divisor folded into the decoding give, bit for bit (+0.0 included, whatever the sign of the
    scale), what a division and a masked fill after the call give; fed back or not, the errors agree too."""
    numel, world = padded_numel(1000, 4), 4
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=generator)
    flags = torch.rand(numel, generator=generator) < 0.3
    flags[1000:] = False  # padding is never flagged

    def run(folded: bool):
        buffer, worker, server = torch.zeros(numel), torch.randn(numel, generator=torch.Generator().manual_seed(1)), \
            torch.zeros(numel // world)
        if fed_back and folded:
            worker.add_(x)
        else:
            buffer.copy_(x)
        options = dict(fed_back=fed_back and folded, divisor=divisor if folded else None,
                       zeroed=zero_codes_(flags.clone()) if folded else None)
        compressed_allreduce_(buffer, worker, server, MirrorComm(world), **options)
        if not folded:
            if divisor is not None:
                buffer.div_(divisor)
            buffer.masked_fill_(flags, 0.0)
        return buffer, worker, server

    folded, after = run(True), run(False)
    for a, b in zip(folded, after, strict=True):
        assert torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))
    assert not folded[0][flags].any() and folded[0][~flags].all()


def test_zero_codes_pack_the_flags_8_to_a_byte():
    flags = torch.tensor([1, 0, 0, 1, 0, 1, 1, 0] * 2, dtype=torch.bool)
    assert zero_codes_(flags).tolist() == [0x96] * 2


def _reference(inputs: torch.Tensor, worker_errors: torch.Tensor, server_errors: torch.Tensor) -> torch.Tensor:
    """The equivalence spec in plain torch (no packing, no collectives), updating the errors in place.

    `inputs` and `worker_errors` are (W, N'), `server_errors` (W, N'/W): every rank's vectors side by side.
    """
    world, padded = inputs.shape
    z = inputs + worker_errors
    scales = torch.linalg.vector_norm(z, dim=1, keepdim=True) / math.sqrt(padded)
    signs = torch.where(z >= 0, 1.0, -1.0)
    worker_errors.copy_(z - scales * signs)
    chunk = padded // world
    out = []
    for j in range(world):
        weighted = signs[:, j * chunk:(j + 1) * chunk] * (scales * (1.0 / world))
        server = weighted.sum(0) + server_errors[j]
        scale = torch.linalg.vector_norm(server) / math.sqrt(chunk)
        server_sign = torch.where(server >= 0, 1.0, -1.0)
        server_errors[j] = server - scale * server_sign
        out.append(scale * server_sign)
    return torch.cat(out)


def _ranks_compress(rank, world_size, numel, calls):
    comm = Comm()
    padded = padded_numel(numel, world_size)
    worker_error, server_error = torch.zeros(padded), torch.zeros(padded // world_size)
    outputs, counts = [], []
    for call in range(calls):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + rank)) * (rank + 1)
        buffer = torch.nn.functional.pad(x, (0, padded - numel))
        outputs.append(compressed_allreduce_(buffer, worker_error, server_error, comm)[:numel].clone())
        counts.append(comm.take_counts())
    # Running-mean oracle: repeated calls on one fixed input; the mean of the outputs converges to the mean.
    fixed = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) + rank
    truth = torch.zeros(numel)
    comm.all_reduce(truth.add_(fixed))
    truth /= world_size
    comm.take_counts()
    worker_error.zero_(), server_error.zero_()
    running = torch.zeros(numel)
    errors = {}
    for call in range(1, 201):
        buffer = torch.nn.functional.pad(fixed, (0, padded - numel))
        running += compressed_allreduce_(buffer, worker_error, server_error, comm)[:numel]
        if call in (1, 10, 200):
            errors[call] = float(torch.linalg.vector_norm(running / call - truth) / torch.linalg.vector_norm(truth))
    return outputs, counts, errors


NUMEL, CALLS = 1000, 4  # 1000 is no multiple of W * lcm(W, 8) for W = 2, 3, 4


def _ranks_worker(rank, world_size):
    """Everything one world size checks, from one spawn (each spawn costs seconds of imports): the equivalence
    spec, and on 2 ranks the buckets too; each part with its own Comm."""
    compress = _ranks_compress(rank, world_size, NUMEL, CALLS)
    return compress, _ranks_buckets(rank, world_size) if world_size == 2 else None


@functools.cache
def _ranks(world_size: int) -> list[tuple]:
    return run_on_ranks(_ranks_worker, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_matches_the_equivalence_spec_on_gloo(world_size):
    numel, calls = NUMEL, CALLS
    results = [compress for compress, _ in _ranks(world_size)]
    padded = padded_numel(numel, world_size)
    worker_errors, server_errors = torch.zeros(world_size, padded), torch.zeros(world_size, padded // world_size)
    for call in range(calls):
        inputs = torch.stack([
            torch.nn.functional.pad(torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + r))
                                    * (r + 1), (0, padded - numel))
            for r in range(world_size)
        ])
        expected = _reference(inputs, worker_errors, server_errors)[:numel]
        for outputs, _, _ in results:
            torch.testing.assert_close(outputs[call], expected, rtol=1e-6, atol=1e-7)
            assert torch.equal(outputs[call], results[0][0][call])  # bit-identical on every rank
    for _, counts, errors in results:
        assert counts == [{"bytes": compressed_bytes_per_call(numel, world_size), "control_bytes": 0,
                           "collectives": 2}] * calls
        # 1 bit per element plus the scales: about 1/32 of fp32 on the wire, (1 + 1/W)/32 of it in Comm's count
        assert compressed_bytes_per_call(numel, world_size) == padded // 8 + padded // (8 * world_size) + 4 * (
            world_size + 1)
        assert errors[1] > 0.3  # one call is a coarse estimate ...
        assert errors[200] < 0.05 < errors[10]  # ... but the errors feed back: the running mean converges


def _ranks_buckets(rank, world_size):
    comm = Comm()
    layout = FlatLayout.packed([torch.Size((3, 5)), torch.Size((7,))], [0, 0], [[0, 1]],
                               padded=lambda size: padded_numel(size, world_size))
    state = FlatState(layout, torch.device("cpu"), torch.float32)
    flat = state.add("exp_avg")
    buckets = CompressedBuckets(layout, comm, torch.device("cpu"), keep_tail=True)
    tensors = state.views("exp_avg")  # the tensors live in the bucket's padded buffer
    tensors[0].fill_(rank + 1.0)
    tensors[1].copy_(torch.arange(7.0) * (rank + 1))
    buckets.allreduce_(flat)
    tensors = [t.clone() for t in tensors]
    tail = flat[22:].clone()
    dense = [torch.full((4,), float(rank)), torch.ones(3) * rank]
    average_tensors_(dense, comm, bucket_numel=4)  # two all-reduces: the 7 elements end to end, cut after 4
    return tensors, tail, dense, buckets.bytes_per_call(), comm.take_counts()


@pytest.mark.slow
def test_buckets_keep_their_padded_tail_and_dense_average():
    results = [buckets for _, buckets in _ranks(2)]
    for tensors, tail, dense, bytes_per_call, counts in results:
        assert torch.equal(tensors[0], results[0][0][0]) and tensors[0].shape == (3, 5)
        assert tail.numel() == padded_numel(22, 2) - 22 and bool((tail != 0).all())  # decoded output, not zeros
        assert [d.tolist() for d in dense] == [[0.5] * 4, [0.5] * 3]
        assert counts["bytes"] == bytes_per_call + 7 * 4 and counts["collectives"] == 2 + 2
