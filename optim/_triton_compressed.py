"""The 1-bit compressed all-reduce's passes (`optim.compressed`) as Triton kernels: each compression in two passes
over its vector and the decoding in one, about 6.5 passes over the vector's size at 2 ranks where the aten ops take
about 18.6 (`benchmarks.optim.step_cost`).

A compression of `z` (the worker's `x + error`, or the server's scale-weighted sum of the ranks' signs plus its
error) needs the norm of `z` before any sign is scaled, so it is two passes that each form `z` again from what it
is the sum of, `z` never stored:

1. `sign_square_sums`: per block of `BLOCK` elements the sum of `z^2` (read x and the error, or the ranks' packed
   signs and the server error);
2. `rms_scale`: those sums added in a fixed order into `||z|| / sqrt(numel)` (no atomic adds: every rank computes
   the same bits);
3. `sign_compress`: the error `z - scale * sign(z)` written, and the sign bits packed 8 to a byte straight into the
   rows the collective sends.

`decode_signs` writes each rank's `+-scale` from its bits (a flagged element +0.0), one pass over the result. The
values are those of the aten ops but for the order of the norm's sum (a few units in the last place of the scale);
the signs and the server's sum, in rank order, are bit for bit theirs. Each kernel is a torch custom op, so the
step-cost count sees its tensors, and meta tensors pass through it. This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from optim._triton import SUM_BLOCK, kernel_op

BLOCK = 2048  # elements per program: 256 packed bytes


@triton.jit
def _compressed_vector(offsets, inside, error, x, signs, sign_stride, weights, ranks, SOURCE: tl.constexpr):
    """`z` at `offsets`: the error alone (SOURCE 0), `x + error` (1), or `sum_j weights[j] * sign_j + error` over the
    `ranks` rows of packed signs (2), summed in rank order from +0.0 as `optim.compressed._decode_sum_into_` does."""
    e = tl.load(error + offsets, mask=inside, other=0.0)
    if SOURCE == 1:
        return tl.load(x + offsets, mask=inside, other=0.0) + e
    if SOURCE == 2:
        total = tl.zeros(offsets.shape, dtype=tl.float32)
        shift = (7 - offsets % 8).to(tl.int32)
        for rank in range(ranks):
            byte = tl.load(signs + rank * sign_stride + offsets // 8, mask=inside, other=0).to(tl.int32)
            weight = tl.load(weights + rank)
            total += tl.where(((byte >> shift) & 1) != 0, weight, -weight)
        return tl.where(inside, total + e, 0.0)  # 0 past the end, as the loads there give
    return e


@triton.jit
def _square_sums(partials, numel, error, x, signs, sign_stride, weights, ranks, SOURCE: tl.constexpr,
                 BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    z = _compressed_vector(offsets, inside, error, x, signs, sign_stride, weights, ranks, SOURCE)
    tl.store(partials + tl.program_id(0), tl.sum(z * z, axis=0))


@triton.jit
def _rms(partials, count, out, root_numel, SUM_BLOCK: tl.constexpr):
    total = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(0, count, SUM_BLOCK):
        at = start + tl.arange(0, SUM_BLOCK)
        total += tl.load(partials + at, mask=at < count, other=0.0)
    tl.store(out, tl.sqrt(tl.sum(total, axis=0)) / root_numel)


@triton.jit
def _compress(packed, row_bytes, packed_stride, numel, scale, error, x, signs, sign_stride, weights, ranks,
              SOURCE: tl.constexpr, BLOCK: tl.constexpr):
    bytes_ = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    bits = tl.arange(0, 8)
    offsets = bytes_[:, None] * 8 + bits[None, :]  # (bytes, 8): a byte's elements in a row
    inside = offsets < numel
    z = _compressed_vector(offsets, inside, error, x, signs, sign_stride, weights, ranks, SOURCE)
    negative = z.to(tl.int32, bitcast=True) < 0  # the sign bit, as `torch.signbit` (z is never -0.0)
    s = tl.load(scale)
    tl.store(error + offsets, z - tl.where(negative, -s, s), mask=inside)
    codes = tl.sum(tl.where(negative, 0, 1 << (7 - bits[None, :])), axis=1)  # MSB first, a set bit for z >= 0
    at = (bytes_ // row_bytes) * packed_stride + bytes_ % row_bytes
    tl.store(packed + at, codes.to(tl.uint8), mask=bytes_ < numel // 8)


@triton.jit
def _decode(out, row_numel, signs, sign_stride, scales, zeroed, HAS_ZEROED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < row_numel
    shift = (7 - offsets % 8).to(tl.int32)
    byte = tl.load(signs + row * sign_stride + offsets // 8, mask=inside, other=0).to(tl.int32)
    scale = tl.load(scales + row)
    values = tl.where(((byte >> shift) & 1) != 0, scale, -scale)
    if HAS_ZEROED:
        code = tl.load(zeroed + row * (row_numel // 8) + offsets // 8, mask=inside, other=0).to(tl.int32)
        values = tl.where(((code >> shift) & 1) != 0, 0.0, values)
    tl.store(out + row * row_numel + offsets, values, mask=inside)


# ------------------------------------------------------------------------------------------ ops
def _source(x: Tensor | None, signs: Tensor | None, weights: Tensor | None, error: Tensor) -> tuple:
    """The kernels' description of `z`: its kind and its operands (unused ones point at the error)."""
    if signs is not None:
        if signs.stride(1) != 1 or weights is None:
            raise ValueError("sign rows must be contiguous rows of packed bytes, with a weight per row")
        return 2, error, signs, signs.stride(0), weights.reshape(-1), signs.size(0)
    return (1 if x is not None else 0), (x if x is not None else error), error, 0, error, 0


def _check(*vectors: Tensor | None) -> None:
    for t in vectors:
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()):
            raise ValueError(f"the compressed all-reduce's Triton kernels take contiguous fp32 vectors, not {t.dtype} "
                             f"of strides {t.stride()}")


@kernel_op("slamb_optim::sign_square_sums", mutates_args=())
def sign_square_sums(error: Tensor, x: Tensor | None, signs: Tensor | None, weights: Tensor | None) -> Tensor:
    """Per block of `BLOCK` elements the sum of `z^2`, `z` as `sign_compress` forms it: a float32 vector."""
    _check(error, x, weights)
    partials = torch.empty(triton.cdiv(error.numel(), BLOCK), dtype=torch.float32, device=error.device)
    if partials.numel():
        kind, x_, signs_, stride, weights_, ranks = _source(x, signs, weights, error)
        _square_sums[(partials.numel(),)](partials, error.numel(), error, x_, signs_, stride, weights_, ranks,
                                          SOURCE=kind, BLOCK=BLOCK)
    return partials


@sign_square_sums.register_fake
def _(error, x, signs, weights):
    return error.new_empty(-(-error.numel() // BLOCK), dtype=torch.float32)


@kernel_op("slamb_optim::rms_scale", mutates_args=())
def rms_scale(partials: Tensor, numel: int) -> Tensor:
    """`||z|| / sqrt(numel)` from `sign_square_sums`' block sums, as a (1,) float32 tensor."""
    out = partials.new_empty(1)
    _rms[(1,)](partials, partials.numel(), out, math.sqrt(numel), SUM_BLOCK=SUM_BLOCK)
    return out


@rms_scale.register_fake
def _(partials, numel):
    return partials.new_empty(1)


@kernel_op("slamb_optim::sign_compress", mutates_args=("error", "packed"))
def sign_compress(error: Tensor, x: Tensor | None, signs: Tensor | None, weights: Tensor | None, scale: Tensor,
                  packed: Tensor) -> None:
    """`error = z - scale * sign(z)` and the sign bits of `z` packed into `packed`: rows of uint8 (any row stride),
    filled row after row, `error.numel() / 8` bytes in all."""
    _check(error, x, weights)
    if packed.stride(-1) != 1 or packed.numel() * 8 != error.numel():
        raise ValueError(f"packed signs: {error.numel() // 8} bytes in rows of contiguous bytes, got {packed.shape}")
    rows = packed.reshape(-1, packed.size(-1)) if packed.dim() > 1 else packed.unsqueeze(0)
    if error.numel():
        kind, x_, signs_, stride, weights_, ranks = _source(x, signs, weights, error)
        _compress[(triton.cdiv(error.numel(), BLOCK),)](
            packed, rows.size(1), rows.stride(0), error.numel(), scale, error, x_, signs_, stride, weights_, ranks,
            SOURCE=kind, BLOCK=BLOCK)


@sign_compress.register_fake
def _(error, x, signs, weights, scale, packed):
    return None


@kernel_op("slamb_optim::decode_signs", mutates_args=("out",))
def decode_signs(out: Tensor, signs: Tensor, scales: Tensor, zeroed: Tensor | None) -> None:
    """`out[j] = +-scales[j]` from the bits of `signs[j]` for each row j of `out` (rows, n), contiguous fp32; with
    `zeroed` (`optim.compressed.zero_codes_` of `out`'s elements) the flagged elements +0.0."""
    if out.dtype != torch.float32 or not out.is_contiguous() or signs.stride(-1) != 1:
        raise ValueError("decode_signs: a contiguous fp32 output and rows of contiguous packed bytes")
    if out.numel():
        _decode[(triton.cdiv(out.size(1), BLOCK), out.size(0))](
            out, out.size(1), signs, signs.stride(0), scales.reshape(-1).float().contiguous(),
            zeroed if zeroed is not None else signs, HAS_ZEROED=zeroed is not None, BLOCK=BLOCK)


@decode_signs.register_fake
def _(out, signs, scales, zeroed):
    return None


def triton_compress(error: Tensor, packed: Tensor, x: Tensor | None = None, signs: Tensor | None = None,
                    weights: Tensor | None = None) -> Tensor:
    """`optim.compressed.compress_` of `z` (the error alone, `x + error`, or the server's weighted sum of `signs`
    plus the error) in the kernels: the error and `packed` written, the scale returned (shape (1,))."""
    scale = rms_scale(sign_square_sums(error, x, signs, weights), error.numel())
    sign_compress(error, x, signs, weights, scale, packed)
    return scale
