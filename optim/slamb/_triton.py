"""SLAMB's local pass and update in Triton kernels (`optim._triton`): each a launch or two per chunk, however many
slots it holds (`SLAMB(triton=True)`).

- The local pass (`triton_local_pass`): `moments_and_block_sums` reads g, m, v and w and writes m, v and the direction
  buffer, and `block_norms` adds each slot's block sums into the norms of its weights and direction: 7 tensor-sized
  reads and writes where the aten ops (a copy of the weights, torch's fused Adam kernel, two norms) take 11.
- The weights at S_t (`gather_rows`): the masked slots' selected rows read from the weights themselves into the
  compact vector, one launch where the aten ops take an index_select per tensor (the buffer that would let one
  gather per span serve them holds the direction, not the weights, after the fused pass).
- The update (`slamb_apply`): `w += c * u`, c the slot's coefficient (an always-synced slot) or its row's (a masked
  slot: one per `row_size` coordinates, read from the chunk's row coefficients), u read from the direction buffer: 3
  reads and writes where a GPU's aten ops take 5 (the rows scaled in place, then a foreach addition).

This module imports triton (see `optim._triton`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from optim import _triton
from optim._triton import (
    DTYPES,
    address_table,
    block_norms,
    block_of,
    blocks,
    load_block,
    moments_and_block_sums,
    on_device,
    words_of_16_bytes,
)
from optim.slamb._layout import Chunk
from optim.slamb._masks import Mask, _starts


def triton_local_pass(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                      directions: list[Tensor], factor: float, eps: float, *, beta1: float, beta2: float,
                      decay_in_norms: bool) -> tuple[Tensor, Tensor]:
    """m, v and the direction buffer `[w +] factor m / (sqrt(v) + eps)` of a chunk's slots, and per slot the norms of
    w and of the buffer (`SLAMB._local_directions`' pass, with the norms its trust ratios take)."""
    partials = moments_and_block_sums(params, grads, exp_avgs, exp_avg_sqs, directions, None, beta1, beta2, factor,
                                      1.0, eps, 1.0 if decay_in_norms else 0.0)
    weight_norms, direction_norms = block_norms(partials, [p.numel() for p in params])
    return weight_norms, direction_norms


@triton.jit
def _apply(addresses, count, tensor_of_block, first_element, numels, row_first, row_shift, slot_coefs, row_coefs,
           W_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    _, u = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    shift = tl.load(row_shift + tensor)  # log2 of the row size; -1: one coefficient for the slot
    per_row = shift >= 0
    row = tl.load(row_first + tensor) + (offsets >> tl.maximum(shift, 0))
    coef = tl.where(per_row, tl.load(row_coefs + row, mask=inside & per_row, other=0.0), tl.load(slot_coefs + tensor))
    tl.store(w_at + offsets, (w + u * coef).to(W_DTYPE), mask=inside)


@functools.cache
def _row_tables(row_first: tuple[int, ...], row_shift: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    return (on_device(torch.tensor(row_first, dtype=torch.int64), device),
            on_device(torch.tensor(row_shift, dtype=torch.int64), device))


@torch.library.custom_op("slamb_optim::slamb_apply", mutates_args=("params",))
def slamb_apply(params: list[Tensor], directions: list[Tensor], slot_coefs: Tensor, row_coefs: Tensor,
                row_first: list[int], row_shift: list[int]) -> None:
    """`w += c * u` per slot: c is `slot_coefs[i]` where `row_shift[i]` is -1, else the coefficient of the element's
    row, `row_coefs[row_first[i] + element >> row_shift[i]]` (rows of 2^row_shift elements)."""
    device, sizes = params[0].device, tuple(p.numel() for p in params)
    tensor_of_block, first_element, numels, _ = blocks(sizes, _triton.BLOCK, device)
    if tensor_of_block.numel():
        addresses, aligned = address_table(device, params, directions)
        _apply[(tensor_of_block.numel(),)](
            addresses, len(params), tensor_of_block, first_element, numels,
            *_row_tables(tuple(row_first), tuple(row_shift), device), slot_coefs, row_coefs,
            W_DTYPE=DTYPES[params[0].dtype], BLOCK=_triton.BLOCK,
            ALIGNED=words_of_16_bytes(aligned, sizes))


@slamb_apply.register_fake
def _(params, directions, slot_coefs, row_coefs, row_first, row_shift):
    return None


@triton.jit
def _gather(addresses, tensor_of_block, first_element, sizes, rows, row_start, bases, shifts, starts, out,
            W_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    tensor, at, inside = block_of(tensor_of_block, first_element, sizes, BLOCK, False)  # the selected coordinates
    shift = tl.load(shifts + tensor)
    row = tl.load(rows + tl.load(row_start + tensor) + (at >> shift), mask=inside, other=0).to(tl.int64)
    coordinate = ((row - tl.load(bases + tensor)) << shift) + (at - ((at >> shift) << shift))
    w_at = tl.load(addresses + tensor).to(tl.pointer_type(W_DTYPE))
    w = tl.load(w_at + coordinate, mask=inside, other=0.0).to(tl.float32)
    tl.store(out + tl.load(starts + tensor) + at, w, mask=inside)


@functools.cache
def _columns(device: torch.device, *columns: tuple[int, ...]) -> tuple[Tensor, ...]:
    return tuple(on_device(torch.tensor(column, dtype=torch.int64), device) for column in columns)


@torch.library.custom_op("slamb_optim::gather_rows", mutates_args=("out",))
def gather_rows(params: list[Tensor], rows: Tensor, out: Tensor, sizes: list[int], row_start: list[int],
                bases: list[int], shifts: list[int]) -> None:
    """`out` <- per tensor i, `sizes[i]` coordinates: its rows (of 2^shifts[i] elements) `rows[row_start[i]:] -
    bases[i]`, in fp32, tensor after tensor. Reads only those rows (`benchmarks.common.StepTraffic` counts them)."""
    device = out.device
    tensor_of_block, first_element, numels, _ = blocks(tuple(sizes), _triton.BLOCK, device)
    if tensor_of_block.numel():
        _gather[(tensor_of_block.numel(),)](
            address_table(device, params)[0], tensor_of_block, first_element, numels, rows,
            *_columns(device, tuple(row_start), tuple(bases), tuple(shifts), tuple(_starts(sizes))), out,
            W_DTYPE=DTYPES[params[0].dtype], BLOCK=_triton.BLOCK)


@gather_rows.register_fake
def _(params, rows, out, sizes, row_start, bases, shifts):
    return None


def triton_gather_weights(chunk: Chunk, mask: Mask, out: Tensor) -> None:
    """`out` <- the chunk's masked weights at S_t, in fp32 (what `Layout.gather_weights` gathers), in one launch."""
    if not chunk.masked:
        return
    counts = [size // s.row_size for s, size in zip(chunk.masked, mask.sizes, strict=True)]
    gather_rows([s.param for s in chunk.masked], mask.rows, out, list(mask.sizes), _starts(counts), list(chunk.bases),
                [s.row_size.bit_length() - 1 for s in chunk.masked])
