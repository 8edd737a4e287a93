"""SLAMB's step in Triton kernels (`optim._triton`): each a launch or two per chunk, however many slots it holds
(`SLAMB(triton=True)`).

- The local pass (`triton_local_pass`): `moments_and_block_sums` reads g, m, v and w and writes m, v and the direction
  buffer, and `block_norms` adds each slot's block sums into the norms of its weights and direction: 7 tensor-sized
  reads and writes where the aten ops (a copy of the weights, torch's fused Adam kernel, two norms) take 11.
- The values at S_t (`gather_rows`): the masked slots' selected rows of the weights (read from the tensors
  themselves), of m and of v, in one launch that reads the mask's rows once, where the aten ops take an index_select
  per tensor for the weights and one per span for m and for v (on an H100 torch's row gather moved a tenth of
  BERT-Large's m and v at about 240 GB/s: 2.6 of the 8.55 ms of the kernels' step).
- The trust ratios: `fresh_direction_sums` forms the masked slots' direction at S_t (before and after the average)
  with per-block sums of its squares and of the weights' there, and `trust_ratios` turns those and the local pass's
  norms into every slot's phi_F and phi_U in one launch (the aten ops: about 30 small ops per chunk).
- The update: `w += c * u`, u read from the direction buffer, c the slot's coefficient (an always-synced slot) or
  its row's (a masked slot: one per `row_size` coordinates). `slamb_apply_rescaled` forms c as it adds, from the
  slot's ratios and the row's freshness (the default `sum_of_products` rescale); `slamb_apply` reads it from the
  chunk's row coefficients (the product form). 3 reads and writes where a GPU's aten ops take 5 (the rows scaled in
  place, then a foreach addition), and none for the coefficients.

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
    kernel_op,
    load_block,
    moments_and_block_sums,
    multi_tensor_launch,
    on_device,
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
def _row_of(row_first, row_shift, tensor, offsets):
    """Whether the slot's coefficient is per row of the mask, and each element's row (the chunk's rows counted)."""
    shift = tl.load(row_shift + tensor)  # log2 of the row size; -1: one coefficient for the slot
    return shift >= 0, tl.load(row_first + tensor) + (offsets >> tl.maximum(shift, 0))


@triton.jit
def _apply(addresses, count, tensor_of_block, first_element, numels, row_first, row_shift, slot_coefs, row_coefs,
           W_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    _, u = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    per_row, row = _row_of(row_first, row_shift, tensor, offsets)
    coef = tl.where(per_row, tl.load(row_coefs + row, mask=inside & per_row, other=0.0), tl.load(slot_coefs + tensor))
    tl.store(w_at + offsets, (w + u * coef).to(W_DTYPE), mask=inside)


@triton.jit
def _apply_rescaled(addresses, count, tensor_of_block, first_element, numels, row_first, row_shift, fresh, stale,
                    one_d, freshness, c_min, c_max, clamp_1d, adapt, lr_fresh, lr_stale, to_freshness,
                    W_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    w_at, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    _, u = load_block(addresses, count + tensor, offsets, inside, tl.float32, ALIGNED)
    phi_f = tl.load(fresh + tensor)
    phi_u = tl.load(stale + tensor)
    clamped = (adapt != 0) & ((clamp_1d != 0) | (tl.load(one_d + tensor) == 0))  # `SLAMB._clamp_ratios`
    phi_f = tl.where(clamped, tl.minimum(tl.maximum(phi_f, c_min), c_max), phi_f)
    phi_u = tl.where(clamped, tl.minimum(tl.maximum(phi_u, 0.0), c_max), phi_u)
    fresh_coef = phi_f * -lr_fresh
    stale_coef = phi_u * -lr_stale
    slope = (fresh_coef - stale_coef) * to_freshness  # per unit of q: coef = stale_coef + q slope
    per_row, row = _row_of(row_first, row_shift, tensor, offsets)
    q = tl.load(freshness + row, mask=inside & per_row, other=0.0).to(tl.float32)
    coef = tl.where(per_row, stale_coef + q * slope, fresh_coef)
    tl.store(w_at + offsets, (w + u * coef).to(W_DTYPE), mask=inside)


@kernel_op("slamb_optim::slamb_apply", mutates_args=("params",))
def slamb_apply(params: list[Tensor], directions: list[Tensor], slot_coefs: Tensor, row_coefs: Tensor,
                row_first: Tensor, row_shift: Tensor) -> None:
    """`w += c * u` per slot: c is `slot_coefs[i]` where `row_shift[i]` is -1, else the coefficient of the element's
    row, `row_coefs[row_first[i] + element >> row_shift[i]]` (rows of 2^row_shift elements)."""
    _launch_update(_apply, params, directions, row_first, row_shift, slot_coefs, row_coefs)


def _launch_update(kernel, params: list[Tensor], directions: list[Tensor], row_first: Tensor, row_shift: Tensor,
                   *args) -> None:
    """An update kernel over the chunk's slots, a program per block, with their rows' tables and then `args`."""
    launch = multi_tensor_launch(params, directions)
    if launch.programs:
        kernel[(launch.programs,)](*launch.head, row_first, row_shift, *args, W_DTYPE=DTYPES[params[0].dtype],
                                   BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)


@slamb_apply.register_fake
def _(params, directions, slot_coefs, row_coefs, row_first, row_shift):
    return None


@kernel_op("slamb_optim::slamb_apply_rescaled", mutates_args=("params",))
def slamb_apply_rescaled(params: list[Tensor], directions: list[Tensor], fresh: Tensor, stale: Tensor, one_d: Tensor,
                         freshness: Tensor, row_first: Tensor, row_shift: Tensor, c_min: float, c_max: float,
                         clamp_1d: bool, adapt: bool, lr_fresh: float, lr_stale: float, to_freshness: float) -> None:
    """`w += c * u` per slot with the default rescale (`sum_of_products`), c formed as it adds from the slot's raw
    ratios phi_F and phi_U (`fresh`, `stale`; clamped as `SLAMB._clamp_ratios` clamps them where `adapt`) and, in a
    masked slot, the row's scaled freshness q (`freshness`, the chunk's rows; `row_first`, `row_shift` as in
    `slamb_apply`): `c = -lr_stale phi_U + q to_freshness (-lr_fresh phi_F + lr_stale phi_U)`, `-lr_fresh phi_F` in a
    slot synced whole."""
    _launch_update(_apply_rescaled, params, directions, row_first, row_shift, fresh, stale, one_d, freshness, c_min,
                   c_max, int(clamp_1d), int(adapt), lr_fresh, lr_stale, to_freshness)


@slamb_apply_rescaled.register_fake
def _(params, directions, fresh, stale, one_d, freshness, row_first, row_shift, c_min, c_max, clamp_1d, adapt,
      lr_fresh, lr_stale, to_freshness):
    return None


@triton.jit
def _gather(sources, count, tensor_of_block, first_element, sizes, rows, row_start, bases, shifts, starts, outs,
            WEIGHTS: tl.constexpr, MOMENTS: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    """The lists of `gather_rows`: the weights if WEIGHTS (1), then m and v if MOMENTS."""
    tensor, at, inside = block_of(tensor_of_block, first_element, sizes, BLOCK, False)  # the selected coordinates
    shift = tl.load(shifts + tensor)
    row = tl.load(rows + tl.load(row_start + tensor) + (at >> shift), mask=inside, other=0).to(tl.int64)
    coordinate = ((row - tl.load(bases + tensor)) << shift) + (at - ((at >> shift) << shift))
    target = tl.load(starts + tensor) + at
    if WEIGHTS:  # the weights, in their dtype, from the first list
        _copy_at(sources, tensor, coordinate, outs, target, inside, W_DTYPE)
    if MOMENTS:  # m and v, in fp32, from the lists after it
        _copy_at(sources + WEIGHTS * count, tensor, coordinate, outs + WEIGHTS, target, inside, tl.float32)
        _copy_at(sources + (WEIGHTS + 1) * count, tensor, coordinate, outs + (WEIGHTS + 1), target, inside,
                 tl.float32)


@triton.jit
def _copy_at(sources, tensor, coordinate, outs, target, inside, DTYPE: tl.constexpr):
    """`outs[0][target] <- sources[tensor][coordinate]` in fp32: one list's selected coordinates into its output."""
    source = tl.load(sources + tensor).to(tl.pointer_type(DTYPE))
    out = tl.load(outs).to(tl.pointer_type(tl.float32))
    tl.store(out + target, tl.load(source + coordinate, mask=inside, other=0.0).to(tl.float32), mask=inside)


@functools.cache
def _columns(device: torch.device, *columns: tuple[int, ...]) -> tuple[Tensor, ...]:
    return tuple(on_device(torch.tensor(column, dtype=torch.int64), device) for column in columns)


@kernel_op("slamb_optim::gather_rows", mutates_args=("outs",))
def gather_rows(sources: list[Tensor], rows: Tensor, outs: list[Tensor], sizes: list[int], row_start: list[int],
                bases: list[int], shifts: list[int], weights: bool) -> None:
    """Per list of `sources` (`len(outs)` lists of `len(sizes)` tensors, list after list: the weights if `weights`,
    then m and v, or m and v alone) its output `outs[j]` <- per tensor i, `sizes[i]` coordinates: its rows (of
    2^shifts[i] elements) `rows[row_start[i]:] - bases[i]`, in fp32, tensor after tensor. Reads the row indices once
    for every list, and of the sources only the selected rows (`benchmarks.common.StepTraffic` counts them)."""
    device = rows.device
    tensor_of_block, first_element, numels, _ = blocks(tuple(sizes), _triton.BLOCK, device)
    if tensor_of_block.numel():
        _gather[(tensor_of_block.numel(),)](
            address_table(device, sources)[0], len(sizes), tensor_of_block, first_element, numels, rows,
            *_columns(device, tuple(row_start), tuple(bases), tuple(shifts), tuple(_starts(sizes))),
            address_table(device, outs)[0], WEIGHTS=int(weights), MOMENTS=len(outs) > int(weights),
            W_DTYPE=DTYPES[sources[0].dtype], BLOCK=_triton.BLOCK)


@gather_rows.register_fake
def _(sources, rows, outs, sizes, row_start, bases, shifts, weights):
    return None


def triton_gather_at_mask(chunk: Chunk, mask: Mask, weights: Tensor | None,
                          moments: tuple[Tensor, Tensor] | None) -> None:
    """The masked slots' values at S_t in fp32, in one launch that reads the mask's rows once: their weights into
    `weights` (what `Layout.gather_weights` gathers) and their m and v into `moments` (the masked parts of the
    compact vector and of the denominators: what `Layout.gather` and `Mask.select` gather), each where given."""
    if not chunk.masked or (weights is None and moments is None):
        return
    always = len(chunk.slots) - len(chunk.masked)
    sources = chunk.params[always:] if weights is not None else []
    if moments is not None:
        sources += chunk.exp_avgs[always:] + chunk.exp_avg_sqs[always:]
    outs = ([weights] if weights is not None else []) + list(moments or ())
    counts = [size // s.row_size for s, size in zip(chunk.masked, mask.sizes, strict=True)]
    gather_rows(sources, mask.rows, outs, list(mask.sizes), _starts(counts), list(chunk.bases),
                [s.row_size.bit_length() - 1 for s in chunk.masked], weights is not None)


# ------------------------------------------------------------------------------------------ the trust ratios
@triton.jit
def _fresh(tensor_of_block, first_element, sizes, starts, fresh, compact, exp_avg_sq, weights, valid, partials,
           total_blocks, factor, eps, DECAY: tl.constexpr, HAS_VALID: tl.constexpr, BLOCK: tl.constexpr):
    segment, at, inside = block_of(tensor_of_block, first_element, sizes, BLOCK, False)
    at = tl.load(starts + segment) + at
    m = tl.load(compact + at, mask=inside, other=0.0)
    d = tl.sqrt(tl.load(exp_avg_sq + at, mask=inside, other=1.0)) + eps  # `SLAMB._denominators`' sqrt(v) + eps
    w = tl.load(weights + at, mask=inside, other=0.0)
    u = w + (factor * m) / d if DECAY else m / d  # `SLAMB._fresh_direction`'s addcdiv or division
    tl.store(fresh + at, u, mask=inside)
    if HAS_VALID:  # a padding duplicate of a selected coordinate counts once
        keep = tl.load(valid + at, mask=inside, other=0.0)
        u, w = u * keep, w * keep
    block = tl.program_id(0)
    tl.store(partials + block, tl.sum(u * u, axis=0))
    tl.store(partials + total_blocks + block, tl.sum(w * w, axis=0))


@functools.cache
def _segments(sizes: tuple[int, ...], block: int, device: torch.device) -> tuple[Tensor, ...]:
    """`blocks` of the compact vector's segments (one per masked slot), with each segment's first coordinate."""
    return (*blocks(sizes, block, device), on_device(torch.tensor(_starts(sizes), dtype=torch.int64), device))


@kernel_op("slamb_optim::fresh_direction_sums", mutates_args=("fresh",))
def fresh_direction_sums(fresh: Tensor, compact: Tensor, exp_avg_sq: Tensor, weights: Tensor, valid: Tensor | None,
                         sizes: list[int], factor: float, eps: float, decay: bool) -> Tensor:
    """The masked slots' direction at S_t, `[weights +] factor compact / (sqrt(exp_avg_sq) + eps)` (v gathered at
    S_t), into `fresh`, and per block of each slot's segment (`sizes`) the sums of its squares and of the weights'
    squares (`valid` ones only): a (2, blocks) float32 tensor."""
    tensor_of_block, first_element, numels, _, starts = _segments(tuple(sizes), _triton.BLOCK, fresh.device)
    partials = torch.empty((2, tensor_of_block.numel()), dtype=torch.float32, device=fresh.device)
    if tensor_of_block.numel():
        _fresh[(tensor_of_block.numel(),)](
            tensor_of_block, first_element, numels, starts, fresh, compact, exp_avg_sq, weights,
            valid if valid is not None else fresh, partials, tensor_of_block.numel(), factor, eps, DECAY=decay,
            HAS_VALID=valid is not None, BLOCK=_triton.BLOCK)
    return partials


@fresh_direction_sums.register_fake
def _(fresh, compact, exp_avg_sq, weights, valid, sizes, factor, eps, decay):
    return fresh.new_empty((2, sum(-(-n // _triton.BLOCK) for n in sizes)), dtype=torch.float32)


@triton.jit
def _segment_sum(partials, row, total_blocks, first, last, SUM_BLOCK: tl.constexpr):
    """The sum of row `row` of `partials` over the blocks [first, last), in a fixed order."""
    total = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(first, last, SUM_BLOCK):
        at = start + tl.arange(0, SUM_BLOCK)
        total += tl.load(partials + row * total_blocks + at, mask=at < last, other=0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _ratios(weight_norms, direction_norms, always_norms, local, averaged, total_blocks, first_block, out, always,
            slots, unit, fallback, SUM_BLOCK: tl.constexpr):
    slot = tl.program_id(0)
    synced = slot < always  # a slot synced whole: everything fresh, no blocks of S_t
    segment = tl.maximum(slot - always, 0)
    first = tl.load(first_block + segment)  # the table holds one entry more than segments: at least one
    last = tl.where(synced, first, tl.load(first_block + segment + 1, mask=slot >= always, other=0))
    w_total = tl.load(weight_norms + slot)
    w_square = _segment_sum(local, 1, total_blocks, first, last, SUM_BLOCK)
    local_square = _segment_sum(local, 0, total_blocks, first, last, SUM_BLOCK)
    averaged_square = _segment_sum(averaged, 0, total_blocks, first, last, SUM_BLOCK)
    u_total = tl.load(direction_norms + segment, mask=slot >= always, other=0.0)
    w_fresh = tl.where(synced, w_total, tl.sqrt(w_square))
    u_fresh = tl.where(synced, tl.load(always_norms + tl.minimum(slot, tl.maximum(always - 1, 0)), mask=synced,
                                       other=0.0), tl.sqrt(averaged_square)) * unit
    u_stale = tl.sqrt(tl.maximum(u_total * u_total - local_square, 0.0)) * unit  # 0 where synced
    w_stale = tl.where(synced, 0.0, tl.sqrt(tl.maximum(w_total * w_total - w_square, 0.0)))
    fresh_adapted = (w_fresh > 0) & (u_fresh > 0)
    stale_adapted = (w_stale > 0) & (u_stale > 0)
    tl.store(out + slot, tl.where(fresh_adapted, w_fresh / tl.where(fresh_adapted, u_fresh, 1.0), 1.0))
    tl.store(out + slots + slot, tl.where(stale_adapted, w_stale / tl.where(stale_adapted, u_stale, 1.0), fallback))


@kernel_op("slamb_optim::slamb_trust_ratios", mutates_args=())
def trust_ratios(weight_norms: Tensor, direction_norms: Tensor, always_norms: Tensor, local: Tensor, averaged: Tensor,
                 sizes: list[int], unit: float, fallback: float) -> Tensor:
    """Per slot the raw phi_F and phi_U (`SLAMB._trust_ratios`), a (2, slots) tensor, from the norms of the weights
    (every slot), of the local direction (masked slots) and of the averaged direction (always-synced slots), and the
    block sums of `fresh_direction_sums` before (`local`) and after (`averaged`) the momentum's average."""
    slots, always = weight_norms.numel(), weight_norms.numel() - len(sizes)
    out = weight_norms.new_empty((2, slots))
    _ratios[(slots,)](weight_norms, direction_norms, always_norms, local, averaged, local.size(1),
                      _segments(tuple(sizes), _triton.BLOCK, weight_norms.device)[3], out, always, slots, unit,
                      fallback, SUM_BLOCK=_triton.SUM_BLOCK)
    return out


@trust_ratios.register_fake
def _(weight_norms, direction_norms, always_norms, local, averaged, sizes, unit, fallback):
    return weight_norms.new_empty((2, weight_norms.numel()))


# ------------------------------------------------------------------------------------------ the averaged direction
@triton.jit
def _always(addresses, count, tensor_of_block, first_element, numels, starts, compact, exp_avg_sq, partials,
            total_blocks, factor, eps, DECAY: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
            ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    _, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    u_at = tl.load(addresses + count + tensor).to(tl.pointer_type(tl.float32))
    at = tl.load(starts + tensor) + offsets
    m = tl.load(compact + at, mask=inside, other=0.0)
    denominator = tl.sqrt(tl.load(exp_avg_sq + at, mask=inside, other=1.0)) + eps
    u = w + (factor * m) / denominator if DECAY else m / denominator  # `SLAMB._average_directions`' formula
    tl.store(u_at + offsets, u, mask=inside)
    block = tl.program_id(0)
    tl.store(partials + block, tl.sum(w * w, axis=0))
    tl.store(partials + total_blocks + block, tl.sum(u * u, axis=0))


@kernel_op("slamb_optim::always_directions", mutates_args=("directions",))
def always_directions(params: list[Tensor], directions: list[Tensor], compact: Tensor, exp_avg_sq: Tensor,
                      starts: Tensor, factor: float, eps: float, decay: bool) -> Tensor:
    """The always-synced slots' direction `[w +] factor m / (sqrt(v) + eps)` formed again from the averaged momentum
    (`compact`, laid out as the chunk's flat region, whose v is `exp_avg_sq`; slot i from `starts[i]`) into
    `directions`, with each block's sums of w^2 and u^2 (`optim._triton.block_norms` takes them): a (2, blocks) tensor.
    The aten ops: the square root and eps, a copy of the weights, a division and the norms, each a pass or a launch."""
    launch = multi_tensor_launch(params, directions)
    partials = torch.empty((2, launch.programs), dtype=torch.float32, device=params[0].device)
    if launch.programs:
        _always[(launch.programs,)](
            *launch.head, starts, compact, exp_avg_sq, partials, launch.programs, factor, eps, DECAY=decay,
            W_DTYPE=DTYPES[params[0].dtype], BLOCK=_triton.BLOCK, ALIGNED=launch.aligned)
    return partials


@always_directions.register_fake
def _(params, directions, compact, exp_avg_sq, starts, factor, eps, decay):
    return params[0].new_empty((2, sum(-(-p.numel() // _triton.BLOCK) for p in params)), dtype=torch.float32)
