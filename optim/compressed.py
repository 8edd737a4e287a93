"""Error-feedback 1-bit compressed all-reduce (DeepSpeed's two-phase scheme) with real bit packing.

Shared by 1-bit Adam, 1-bit LAMB and 0/1 Adam. Each rank compresses its padded
vector to signs (1 bit per element, packed 8 to a byte) and one RMS scale, keeping what the compression lost
in a worker error buffer. Phase 1 is an all-to-all: rank j receives every rank's signs for chunk j, averages
them with the scales, adds its server error and compresses the result again. Phase 2 all-gathers the W
compressed chunks. Every rank decodes the same bytes, so the output is bit-identical across ranks.

Why padding: the vector is padded to a multiple of `W * lcm(W, 8)` so each chunk is whole bytes.
Each scale rides in the same collective as its signs (4 bytes appended per chunk), so one compressed
all-reduce is two collectives, not DeepSpeed's four; the arithmetic is the same.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from optim._compiled import CompiledMath
from optim._math import FOREACH_CHUNK_NUMEL
from optim.comm import Comm
from optim.flat import FlatLayout, copy_in_chunks_

_SCALE_BYTES = 4  # one float32 scale per chunk on the wire
_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # byte -> its 8 signs, MSB first


def padded_numel(numel: int, world_size: int) -> int:
    """N' for a vector of `numel` elements: the next multiple of `W * lcm(W, 8)` (DeepSpeed's padding)."""
    multiple = world_size * (world_size * 8 // math.gcd(world_size, 8))
    return -(-numel // multiple) * multiple


_PACK_MULTIPLIER = 0x8040201008040201 - (1 << 64)  # as int64: sum over k of 2**(63 - 9k)
_TOP_BYTE = 7 if sys.byteorder == "little" else 0  # where an int64's most significant byte sits in memory


def pack_signs(x: Tensor) -> Tensor:
    """Bit k of the result is 1 where `x[k] >= 0`, most significant bit first (numpy `packbits` order).

    `x.numel()` must be a multiple of 8; returns `numel / 8` uint8 bytes. The sign bit decides, so -0.0
    would pack as -1; the compression never produces -0.0 (see `compress_`), where both zeros count as +1.
    """
    packed = torch.empty(x.numel() // 8, dtype=torch.uint8, device=x.device)
    _pack_negative_(torch.signbit(x.reshape(-1)), packed)
    return packed


def _pack_negative_(negative: Tensor, out: Tensor) -> None:
    """Pack the flags `negative` (bool, a multiple of 8 of them) into `out` as `pack_signs` packs their signs;
    the flags are overwritten.

    How: the 8 flags (one byte each, 0 or 1) of a group are one little-endian int64 word; multiplying by
    sum_k 2**(63 - 9k) moves flag k to bit 63 - k of the product without carries (all partial products have
    distinct exponents), so the top byte, read in place, is the packed byte of the negative flags: one `not`
    makes it the sign bits. Two passes over the flags, no loop.
    """
    words = negative.view(torch.int64).mul_(_PACK_MULTIPLIER)
    torch.bitwise_not(words.view(torch.uint8)[_TOP_BYTE::8], out=out)


def _sign_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """(256, 8): row b holds the 8 signs packed in byte b, +1 for a set bit, MSB first.

    Built from `arange` on the device: no host-to-device copy (which would wait for the device).
    """
    key = (dtype, device)
    if key not in _SIGN_TABLES:
        shifts = 7 - torch.arange(8, device=device)
        bits = torch.arange(256, device=device).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1)
        _SIGN_TABLES[key] = bits.to(dtype).mul_(2).sub_(1)
    return _SIGN_TABLES[key]


def zero_codes_(flags: Tensor) -> Tensor:
    """What `compressed_allreduce_` takes to zero elements of its result, made in place of their bool `flags` (a
    multiple of 8, contiguous), which it overwrites: the flags packed 8 to a byte, MSB first, a set bit where a flag
    is set, `numel / 8` uint8 over the first eighth of the flags' bytes.

    A block of the device's foreach chunk at a time (bounded temporaries); block k's codes land on bytes of blocks
    before it or on its own, which are read by then.
    """
    flat, block = flags.reshape(-1), _block_numel(flags)
    codes = flat.view(torch.uint8)[:flat.numel() // 8]
    for a in range(0, flat.numel(), block):
        packed = torch.empty(min(block, flat.numel() - a) // 8, dtype=torch.uint8, device=flags.device)
        _pack_negative_(torch.logical_not(flat[a:a + block]), packed)  # a set bit where a flag is set
        codes[a // 8:a // 8 + packed.numel()].copy_(packed)
    return codes


def unpack_signs(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of `pack_signs`: +1 for a set bit, -1 for a clear one, 8 values per byte, in order.

    A look-up in a (256, 8) table: the plain reading of the format, kept as the reference the decoders are tested
    against (on a GPU a gather of 32-byte rows runs far below bandwidth, which is why the decoders compute).
    """
    return _sign_table(dtype, packed.device)[packed.reshape(-1).int()].reshape(-1)


def _bit_values(packed: Tensor) -> Tensor:
    """The bits of `packed` (uint8, n bytes) as bytes of 0 or 1, MSB first: (n, 8), two elementwise passes."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return torch.bitwise_right_shift(packed.unsqueeze(-1), shifts).bitwise_and_(1)


def _bits(packed: Tensor) -> Tensor:
    """`_bit_values` as bools, for the eager ops: a view, no pass of its own."""
    return _bit_values(packed).view(torch.bool)


def _traced_bits(packed: Tensor) -> Tensor:
    """`_bits` for the passes inductor compiles: shifts of int32 and a comparison, which it fuses into the pass on any
    CPU. Its C++ for a bool view of bytes fails to compile where the CPU has AVX2 but not AVX-512, and its loop for
    shifts of uint8 (which AVX2 lacks) took 20x as long (torch 2.14.1)."""
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=packed.device)
    return torch.bitwise_right_shift(packed.to(torch.int32).unsqueeze(-1), shifts).bitwise_and(1) != 0


_SIGNED_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _traced_signbit(z: Tensor) -> Tensor:
    """`torch.signbit` for the passes inductor compiles: the bits as a signed integer, below 0. Inductor's CPU loop
    takes `signbit` one element at a time, through a buffer, and the compiled compression took 3.4x as long (torch
    2.14.1)."""
    return z.view(_SIGNED_OF_SIZE[z.element_size()]) < 0


def _traced_packing(negative: Tensor) -> Tensor:
    """`_pack_negative_` for the passes inductor compiles: the 8 flags of a byte as its columns, shifted and joined
    in int32, one elementwise loop over the bytes. Inductor's CPU loop for a sum over each 8 shifted uint8 took 65x
    as long (torch 2.14.1)."""
    bits = torch.logical_not(negative).view(-1, 8).to(torch.int32)
    packed = torch.bitwise_left_shift(bits[:, 0], 7)
    for k in range(1, 8):
        packed = packed.bitwise_or(torch.bitwise_left_shift(bits[:, k], 7 - k))
    return packed.to(torch.uint8)


def _decode_into(out: Tensor, packed: Tensor, scales: Tensor, zeroed: Tensor | None = None,
                 compiled: bool = False) -> None:
    """`out[j] = scales[j] * unpack_signs(packed[j])` for each row j of `out` (rows, n), computed from the bits (a
    choice between `+scale` and `-scale`, so bit for bit the table's `+-1 * scale`). With `zeroed` (`zero_codes_`
    of `out`'s elements) the flagged elements are +0.0, as a masked fill after would make them.

    Eager: a block of the device's foreach chunk at a time (bounded temporaries), choosing (`_choose_signs`) and (with
    `zeroed`) filling in passes of their own. `compiled`: each row in one fused pass (`_decode_row_`).
    """
    codes = None if zeroed is None else zeroed.view(out.shape[0], -1)
    for row, (bytes_, scale) in enumerate(zip(packed, scales, strict=True)):
        zero = None if codes is None else codes[row]
        if compiled:
            _DECODE_ROW(out[row], bytes_, scale, zero)
            continue
        block = _block_numel(out[row]) // 8
        for a in range(0, bytes_.numel(), block):
            target = out[row, 8 * a:8 * (a + block)].view(-1, 8)
            _choose_signs(bytes_[a:a + block], scale, target)
            if zero is not None:
                target.masked_fill_(_bits(zero[a:a + block]), 0.0)


def _decode_row_(out: Tensor, packed: Tensor, scale: Tensor, zero: Tensor | None) -> None:
    """`_decode_into`'s arithmetic for one row, for inductor: read the bytes, write the values, nothing between."""
    values = torch.where(_traced_bits(packed), scale, -scale)
    if zero is not None:
        values = torch.where(_traced_bits(zero), 0.0, values)
    out.copy_(values.reshape(-1))


def _decode_sum_into_(out: Tensor, packed: Tensor, weights: Tensor) -> None:
    """`out = sum_j weights[j] * unpack_signs(packed[j])` over the rows j of `packed` (W, n/8), in row order (as
    `torch.sum` over the decoded rows takes it), one decoded row of temporary at a time."""
    rows = out.view(-1, 8)
    for row, (bytes_, weight) in enumerate(zip(packed, weights, strict=True)):
        if row == 0:
            _choose_signs(bytes_, weight, rows)
        else:
            rows.add_(_choose_signs(bytes_, weight, torch.empty_like(rows)))


TABLE_DECODING_DEVICES = frozenset({"cpu"})  # device types whose decoders look the signs up (`_choose_signs`)


def _choose_signs(packed: Tensor, value: Tensor, out: Tensor) -> Tensor:
    """`out` (n, 8) <- `+value` for each set bit of the n bytes `packed`, `-value` for each clear one (bit for bit the
    table's `+-1 * value`). On a CPU by looking each byte's row up in the table times `value`, which stays in cache
    (about a tenth of the time of unpacking and choosing, on one thread of a 2-core AMD EPYC); elsewhere by choosing
    from the unpacked bits (on a GPU a gather of 32-byte rows runs far below bandwidth)."""
    if out.device.type in TABLE_DECODING_DEVICES:
        return torch.index_select(_sign_table(out.dtype, out.device) * value, 0, packed.int(), out=out)
    return torch.where(_bits(packed), value, -value, out=out)


def compress_(z: Tensor, error: Tensor, packed: Tensor | None = None) -> Tensor:
    """1-bit compression of `z` with error feedback: returns the RMS scale `||z|| / sqrt(numel)` (shape (1,)).

    `error` (it may be `z` itself) is overwritten with `z - scale * sign(z)`, sign(0) = +1, and `packed` (if given)
    receives `pack_signs(z)`. Why the sign bit suffices for that rule: `z` is always a sum `x + error` with an error
    buffer that starts at +0.0, and IEEE addition gives -0.0 only for -0.0 + -0.0, so neither `z` nor any later
    error is ever -0.0.

    After the norm, one pass over `z` takes its sign bits, which serve twice: packed, and as +-1 in int8 (a
    quarter of a float's bytes) for one multiply-add `z - scale * sign`, exactly the rounding of the subtraction.
    Both work a block of the device's foreach chunk at a time, so their temporaries stay bounded.
    """
    scale = torch.linalg.vector_norm(z).div_(math.sqrt(z.numel())).reshape(1)
    block = _block_numel(z)
    for a in range(0, z.numel(), block):
        negative = torch.signbit(z[a:a + block])
        signs = torch.rsub(negative.view(torch.int8), 1, alpha=2)  # 1 - 2 negative: +1 or -1
        if packed is not None:
            _pack_negative_(negative, packed[a // 8:(a + block) // 8])
        torch.addcmul(z[a:a + block], signs, scale, value=-1, out=error[a:a + block])
    return scale


# ------------------------------------------------------------------------------------------ compiled compression
# The compressions as inductor compiles them (`compiled=True`): a pass that reduces the norm of the compressed vector,
# reading what it is the sum of, and one that reads them again to write the error and the sign bits; the sum is never
# stored. Inductor packs the signs in a loop of its own over the bytes that reads the summands once more:
# about 7 reads and writes of the vector (`x + error`), where the aten ops write the sum, its sign bits as bytes,
# their packing and the error (about 8).


def _compress_into_(z: Tensor, error: Tensor, packed: Tensor) -> Tensor:
    """`compress_`'s arithmetic for a traced `z` (never stored): `error = z - scale * sign(z)`, `packed` its signs."""
    scale = torch.linalg.vector_norm(z) / math.sqrt(z.numel())
    negative = _traced_signbit(z)
    error.copy_(z - torch.where(negative, -scale, scale))
    packed.copy_(_traced_packing(negative))
    return scale.reshape(1)


def _worker_compress_(x: Tensor | None, error: Tensor, packed: Tensor) -> Tensor:
    """The worker's compression of `x + error` (of `error` alone when it already holds the sum): its scale."""
    return _compress_into_(error if x is None else x + error, error, packed)


def _server_compress_(signs: Tensor, weights: Tensor, error: Tensor, packed: Tensor) -> Tensor:
    """The server's compression of `sum_j weights[j] * signs[j] + error`, `signs` the W ranks' packed rows of its
    chunk (`_decode_sum_into_`'s sum, formed in the same pass): its scale."""
    column = weights.to(error.dtype).reshape(-1, 1, 1)
    decoded = torch.where(_traced_bits(signs), column, -column).sum(0).reshape(-1)  # (W, n / 8, 8) bits
    return _compress_into_(decoded + error, error, packed)


_WORKER_COMPRESS = CompiledMath(_worker_compress_)
_SERVER_COMPRESS = CompiledMath(_server_compress_)
_DECODE_ROW = CompiledMath(_decode_row_)


def _block_numel(buffer: Tensor) -> int:
    """Elements per block of the compression's passes: the device's foreach chunk, a multiple of 8 (whole bytes)."""
    return max(8, (FOREACH_CHUNK_NUMEL.get(buffer.device.type) or buffer.numel()) // 8 * 8)


def _put_scale(rows: Tensor, scale: Tensor) -> None:
    """Write the 4 bytes of the float32 `scale` at the end of each row of packed signs: one collective carries
    both."""
    rows[:, -_SCALE_BYTES:].copy_(scale.to(torch.float32).reshape(1).view(torch.uint8).expand(rows.shape[0], -1))


def _split_scale(rows: Tensor) -> tuple[Tensor, Tensor]:
    """(packed signs, float32 scales of shape (rows, 1)) from rows built by `_put_scale`; the signs are a view (each
    row contiguous: the decoders read them in place). The scales are copied, as 4-byte aligned floats: a single row's
    slice is contiguous already, at any byte offset."""
    scales = rows[:, -_SCALE_BYTES:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return rows[:, :-_SCALE_BYTES], scales


def compressed_allreduce_(buffer: Tensor, worker_error: Tensor, server_error: Tensor, comm: Comm, *,
                          fed_back: bool = False, divisor: float | None = None, zeroed: Tensor | None = None,
                          fused: str | None = None) -> Tensor:
    """Replace the padded flat `buffer` (N' elements) by the 1-bit compressed mean over ranks, in place.

    `worker_error` (N') and `server_error` (N'/W) are this rank's persistent error buffers. The result is
    identical on every rank. Collectives: one all-to-all of N'/8 + 4W bytes and one all-gather of
    N'/(8W) + 4 bytes per rank. With one rank it is the identity (no compression: nothing is sent).

    `fed_back`: the caller has already added its vector to `worker_error` (its last pass wrote `x + error` there
    rather than `x`, one pass fewer), and `buffer` only receives the result. `divisor`: the result divided by it,
    folded into the decoding (exactly `result / divisor`: each value is `+-scale / divisor`). `zeroed`: `zero_codes_`
    of the elements to set to +0.0 as the result is decoded; with one rank, which decodes nothing, the caller zeroes
    them. `fused`: the worker's and the server's compressions and the decoding compiled by inductor ("compiled":
    `_worker_compress_`, `_server_compress_`: the norm, then the error and the signs; `_decode_row_`) or in Triton
    kernels ("triton", `optim._triton_compressed`: fp32 buffers, the signs packed straight into the rows sent), rounded
    apart from the aten ops' within a few units in the last place (the norm's sum in another order).
    """
    world = comm.world_size
    if not comm.distributed or buffer.numel() == 0:
        if fed_back:  # the errors of one rank stay 0: worker_error holds the vector itself
            buffer.copy_(worker_error)
            worker_error.zero_()
        if buffer.numel() == 0:  # DeepSpeed >= 0.18.5: empty tensors return at once, with the errors zeroed
            worker_error.zero_()
            server_error.zero_()
        return buffer if divisor is None else buffer.div_(divisor)
    chunk = buffer.numel() // world
    if buffer.numel() % (8 * world) or worker_error.numel() != buffer.numel() or server_error.numel() != chunk:
        raise ValueError(
            f"compressed_allreduce_: buffer of {buffer.numel()} elements is not padded for {world} ranks "
            f"(use padded_numel) or its error buffers do not match ({worker_error.numel()}, {server_error.numel()})"
        )
    # Temporaries are of at most a block (the device's foreach chunk), not of the buffer's size: at BERT-XL's
    # 2.9B parameters a decoded copy of the buffer would be 11.6 GB.
    block = _block_numel(buffer)
    # Phase 1: worker compression, chunk j of the signs (and this rank's scale) to rank j.
    send = torch.empty(world, chunk // 8 + _SCALE_BYTES, dtype=torch.uint8, device=buffer.device)
    if fused == "triton":
        from optim._triton_compressed import decode_signs, triton_compress  # imports triton: allowed by the optimizer

        worker_scale = triton_compress(worker_error, send[:, :chunk // 8], x=None if fed_back else buffer)
    else:
        packed = torch.empty(buffer.numel() // 8, dtype=torch.uint8, device=buffer.device)
        if fused == "compiled":
            worker_scale = _WORKER_COMPRESS(None if fed_back else buffer, worker_error, packed)
        else:
            worker_scale = compress_(worker_error if fed_back else buffer.add_(worker_error), worker_error, packed)
        send[:, :chunk // 8].copy_(packed.view(world, chunk // 8))
        del packed
    _put_scale(send, worker_scale)
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send)
    del send
    signs, scales = _split_scale(received)
    # Server stage on this rank's chunk: the scale-weighted mean of the W sign vectors, compressed again, a
    # block of columns at a time.
    weights = scales.to(buffer.dtype) * (1.0 / world)  # DeepSpeed multiplies by 1/W rather than dividing
    mine = torch.empty(1, chunk // 8 + _SCALE_BYTES, dtype=torch.uint8, device=buffer.device)
    if fused == "triton":
        server_scale = triton_compress(server_error, mine[0, :chunk // 8], signs=signs, weights=weights)
    elif fused == "compiled":
        server_scale = _SERVER_COMPRESS(signs, weights, server_error, mine[0, :chunk // 8])
    else:
        server = buffer[:chunk]  # the buffer is free until phase 2 decodes into it: the server's vector lives there
        for a in range(0, chunk, block):
            _decode_sum_into_(server[a:a + block], signs[:, a // 8:(a + block) // 8], weights)
            server[a:a + block].add_(server_error[a:a + block])
        server_scale = compress_(server, server_error, mine[0, :chunk // 8])
    _put_scale(mine, server_scale)
    # Phase 2: every rank gets every compressed chunk and decodes the same bytes, straight into the buffer.
    gathered = torch.empty(world, mine.shape[1], dtype=torch.uint8, device=buffer.device)
    comm.all_gather_into_tensor(gathered, mine)
    signs, scales = _split_scale(gathered)
    scales = scales.to(buffer.dtype)
    scales = scales if divisor is None else scales / divisor
    if fused == "triton":
        decode_signs(buffer.view(world, chunk), signs, scales, zeroed)
    else:
        _decode_into(buffer.view(world, chunk), signs, scales, zeroed, compiled=fused == "compiled")
    return buffer


def compressed_bytes_per_call(numel: int, world_size: int) -> int:
    """Bytes a rank is charged by `Comm` for one compressed all-reduce of `numel` elements (0 on one rank).

    Comm charges a rank the size of its input to each collective: N'/8 + 4W for the all-to-all and
    N'/(8W) + 4 for the all-gather. On the wire (ring model) both phases together move 2(W-1)/W * N'/8
    bytes, exactly 1/32 of a ring all-reduce of N fp32 values up to padding.
    """
    if world_size == 1:
        return 0
    padded = padded_numel(numel, world_size)
    return padded // 8 + _SCALE_BYTES * world_size + padded // (8 * world_size) + _SCALE_BYTES


class CompressedBuckets:
    """The compressed all-reduce of a `FlatLayout`'s buckets, with this rank's error buffers.

    A flat buffer with the layout (an optimizer's momentum, say) is all-reduced bucket by bucket in place: its
    per-tensor views are the optimizer's state, so a compressed call copies nothing in or out, as DeepSpeed's
    fused buffers. The worker error follows the layout (one flat buffer, a bucket's error at the bucket's
    place); the server error holds each bucket's 1/W share, bucket after bucket.

    With `keep_tail` the padded tail of a bucket is kept from call to call, as 1-bit LAMB's fused momentum
    buffer is in DeepSpeed (the tail holds the previous decompressed output, which feeds the next compression
    and its scale); without it the tail is zeroed before every call, as DeepSpeed's per-tensor padding. The
    errors and (with `keep_tail`) the tails are rank-specific state: checkpoint them with `state_dict()`.
    `fused`: the compressions compiled by inductor ("compiled") or in Triton kernels ("triton"; see
    `compressed_allreduce_`).
    """

    def __init__(self, layout: FlatLayout, comm: Comm, device: torch.device, dtype: torch.dtype = torch.float32,
                 keep_tail: bool = False, fused: str | None = None) -> None:
        self.layout, self.comm, self.keep_tail, self.fused = layout, comm, keep_tail, fused
        world = comm.world_size
        if any((b.end - b.start) % (8 * world) for b in layout.buckets):
            raise ValueError(f"CompressedBuckets: buckets must be padded for {world} ranks (use padded_numel)")
        self.sizes = [b.size for b in layout.buckets]
        self.worker_error = torch.zeros(layout.numel, device=device, dtype=dtype)
        self.server_error = torch.zeros(sum(b.end - b.start for b in layout.buckets) // world, device=device,
                                        dtype=dtype)
        shares = [(b.end - b.start) // world for b in layout.buckets]
        self._workers = layout.bucket_views(self.worker_error)
        self.worker_views = layout.views(self.worker_error)  # per slot, shaped like its tensor
        self._servers = list(self.server_error.split(shares)) if shares else []

    def allreduce_(self, flat: Tensor, fed_back: bool = False, divisors: Sequence[float] | None = None,
                   zeroed: Sequence[Tensor] | None = None) -> None:
        """Replace each bucket of `flat` (a buffer with the layout) by its compressed mean over ranks, in place.

        `fed_back`: the caller has added its vector to the worker error through `worker_views` (each slot's
        `x + error`), so `flat` only receives the result; the padded tails are fed back here. `divisors` and
        `zeroed`: per bucket, what its result is divided by and the codes of the elements it zeroes
        (`compressed_allreduce_`).
        """
        if not self.comm.distributed and not fed_back and divisors is None:
            return
        for index, (bucket, buffer, worker, server) in enumerate(zip(
                self.layout.buckets, self.layout.bucket_views(flat), self._workers, self._servers, strict=True)):
            if fed_back:
                if self.keep_tail:
                    worker[bucket.size:].add_(buffer[bucket.size:])
            elif not self.keep_tail:
                buffer[bucket.size:].zero_()
            compressed_allreduce_(buffer, worker, server, self.comm, fed_back=fed_back,
                                  divisor=None if divisors is None else divisors[index],
                                  zeroed=None if zeroed is None else zeroed[index], fused=self.fused)

    def bytes_per_call(self) -> int:
        """What one `allreduce_` costs this rank in Comm's bytes, all buckets together."""
        return sum(compressed_bytes_per_call(size, self.comm.world_size) for size in self.sizes)

    def zero_errors_(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    def state_dict(self, flat: Tensor) -> dict[str, Any]:
        """This rank's errors (views: nothing is copied) and the tails of `flat`, per bucket."""
        tails = [buffer[size:].clone() for buffer, size in zip(self.layout.bucket_views(flat), self.sizes,
                                                                strict=True)]
        return {"world_size": self.comm.world_size, "sizes": list(self.sizes), "worker_errors": self._workers,
                "server_errors": self._servers, "tails": tails}

    def load_state_dict(self, state: dict[str, Any], flat: Tensor) -> None:
        """Copy saved errors and tails into this rank's buffers and `flat`, in place."""
        if state["world_size"] != self.comm.world_size or list(state["sizes"]) != self.sizes:
            raise ValueError(
                f"compression state was saved for {state['world_size']} ranks and buckets {state['sizes']}; this "
                f"run has {self.comm.world_size} ranks and buckets {self.sizes}: the per-rank error buffers "
                "cannot be carried over to another world size"
            )
        tails = [buffer[size:] for buffer, size in zip(self.layout.bucket_views(flat), self.sizes, strict=True)]
        for mine, saved in zip([*self._workers, *self._servers, *tails],
                               [*state["worker_errors"], *state["server_errors"], *state["tails"]], strict=True):
            copy_in_chunks_(mine, saved)


def bucket_layout(group_sizes: Sequence[int], bucketing: str) -> list[list[int]]:
    """Indices per bucket for tensors listed group by group: one bucket per tensor, per group, or in all."""
    total = sum(group_sizes)
    if bucketing == "per_tensor":
        return [[i] for i in range(total)]
    if bucketing == "per_group":
        starts = [sum(group_sizes[:g]) for g in range(len(group_sizes))]
        return [list(range(s, s + n)) for s, n in zip(starts, group_sizes, strict=True) if n]
    if bucketing == "flat_scaled":
        return [list(range(total))] if total else []
    raise ValueError(f"bucketing={bucketing!r}; must be 'per_tensor', 'per_group' or 'flat_scaled'")
