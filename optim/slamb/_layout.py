"""SLAMB's placement on the flat engine (`optim.flat`): where m, v and the freshness of every parameter sit, and
the views a step uses.

A step's cost on a GPU is its number of dispatched ops, so every per-tensor quantity a step needs is laid out
once here, and a step works on a few large slices instead of one tensor at a time. Terms (the engine's slot,
bucket and row, with what SLAMB adds):

- slot: one parameter's place in the flat buffers (offset, size, row size, first freshness row), and whether it
  is masked or synced every step.
- row: `row_size` consecutive coordinates of a masked tensor (up to 16, see `_masks.row_size`), which the
  mask selects together; they share one freshness value, so the freshness buffer (`FlatLayout.rows`) holds one
  value per row.
- chunk: a bucket of the layout: consecutive whole slots of one param group, at most `Geometry.chunk_numel`
  elements, stepped one after the other: always-synced slots first, then the masked ones grouped by row size.
- span: a chunk's masked slots of one row size, consecutive in the buffers, so that one row view of a buffer
  (and of the freshness) serves all of them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim.flat import FixedAddresses, FlatLayout, FlatState, runs
from optim.slamb._masks import ROW_NUMEL, Mask, mask_size, row_size


@dataclass(frozen=True)
class Geometry:
    """How a step cuts its work, chosen by the device that runs it (`GEOMETRIES`).

    chunk_numel: elements per chunk (None: a whole param group; a larger tensor forms a chunk of its own). A chunk
        is stepped whole, its momentum all-reduce included, so it bounds the work buffer; on the CPU its passes
        stay in cache.
    draw_picks: rows per draw of the stratified and Bernoulli masks (None: one draw for all chunks). On the CPU a
        draw's passes stay in cache; on a GPU one draw takes the fewest launches.
    per_tensor: whether an op per tensor costs no more than one over a list (a CPU). Where it does (a GPU: each
        launch costs host time), a step dispatches a number of ops independent of the number of tensors, and
        every foreach op takes lists of equal shapes, which CUDA runs as one kernel per list (a broadcast or a
        per-tensor 0-d factor would launch one kernel per tensor).
    draw_ahead: from the end of a step, draw the random numbers of this many next steps, each on a thread of its
        own (`MaskSampler.draw_ahead`), beside the host work that launches the next forward and backward pass (0:
        drawn in the step). An H100 host took 13 ms for one BERT-Large draw, where the Triton kernels' step takes
        about 8: three draws at once keep up with steps run back to back.
    """

    chunk_numel: int | None
    draw_picks: int | None
    per_tensor: bool
    draw_ahead: int


# By device type; any other than the CPU takes the GPU's (`geometry_of`). Tests and the step-cost benchmark may
# give the CPU the GPU's geometry, to run or count a GPU's step there. A GPU's step is bound by its host, and each
# chunk costs host time (its launches, views and Python) whatever its size: 2^29 elements hold BERT-Large's decayed
# tensors in one chunk (2 chunks a step). On one H100 (torch 2.11) its Triton step took 6.13 ms, 3.73 ms of it on the
# host, where 2^28 (3 chunks) took 7.04 and 6.49 ms and 2^27 (4 chunks) 7.14 and 7.07 ms. The work buffer is about
# 5.3 bytes per element of the largest chunk: 1.8 GB at BERT-Large, at most 2.8 GB for any model.
GEOMETRIES = {"cpu": Geometry(1 << 20, 1 << 16, True, 0), "cuda": Geometry(1 << 29, None, False, 3)}


def geometry_of(device: torch.device) -> Geometry:
    """The geometry for parameters on `device`: the GPU's on every device but the CPU (the meta device counts a
    GPU's step)."""
    return GEOMETRIES.get(device.type, GEOMETRIES["cuda"])


_ALIGN = ROW_NUMEL  # masked tensors start at multiples of this many elements: any row size divides it
FRESHNESS_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}  # storage of the scaled freshness
_STRUCT_CODES = {torch.float16: "e", torch.float32: "f"}  # the freshness dtypes' codes in the struct module


@dataclass(frozen=True)
class Slot:
    """Where one parameter's moments and freshness live in the flat buffers."""

    param: Tensor
    offset: int
    numel: int
    always: bool  # 1-D or smaller than min_compress_numel: synced every step
    index: int  # position among all slots: seeds the tensor's cyclic partition
    row_size: int  # the mask selects rows of this many consecutive coordinates (1: single coordinates)
    row: int  # where its freshness starts in the freshness buffer, which holds one value per row

    @property
    def rows(self) -> int:
        return self.numel // self.row_size

    def flat(self, buffer: Tensor, start: int = 0) -> Tensor:
        """This slot's 1-D slice of `buffer`, a flat buffer whose element 0 is flat position `start`."""
        return buffer[self.offset - start:self.offset - start + self.numel]


@dataclass(frozen=True)
class Span:
    """A chunk's masked slots of one row size. The freshness buffer holds their rows in the same order and
    spacing, so a row index relative to the span addresses a row of coordinates and its freshness alike."""

    row_size: int
    start: int  # chunk-relative elements [start, end)
    end: int
    row: int  # the freshness buffer's row of `start`
    slots: tuple[int, int]  # its masked slots' [first, last) indices in the chunk's `masked`

    def of(self, region: Tensor) -> Tensor:
        """The span's rows of a chunk's region of a flat buffer."""
        return region[self.start:self.end].view(-1, self.row_size)

    def freshness(self, scaled_freshness: Tensor) -> Tensor:
        """The span's rows of the freshness buffer."""
        return scaled_freshness[self.row:self.row + (self.end - self.start) // self.row_size]


@dataclass(frozen=True)
class Chunk:
    """Consecutive slots of one param group: always-synced ones in [start, split), masked ones in [split, end).

    Masked slots (and chunks) start at multiples of `_ALIGN` elements, and are placed by row size, so that one row
    view of a buffer over a span serves every masked slot with that row size; the padding (zeros, at most
    `_ALIGN` - 1 elements per masked tensor) is never gathered, sent or normed.
    """

    group: int
    start: int
    split: int
    end: int
    slots: tuple[Slot, ...]
    masked: tuple[Slot, ...]  # the slots in [split, end)
    one_d: Tensor  # per slot, dim <= 1 (on the device, built once: the clamp_1d switch needs no host copy)
    spans: tuple[Span, ...]  # the masked slots by row size
    bases: tuple[int, ...]  # per masked slot, the span-relative index of its first row
    rows: tuple[int, int, int]  # freshness rows: the always-synced slots' in [first, split), masked in [split, end)
    always_numels: Tensor  # per always-synced slot its numel, on the device (spreads per-slot factors over them)
    # Per masked slot, on the device: its position in `slots`, and its rows up to the next masked slot's first
    # row (padding rows included), which spread per-slot factors over the masked rows (`Layout.per_row`).
    masked_at: Tensor
    row_counts: Tensor
    # Per slot, on the device, for the Triton update kernels (`optim.slamb._triton`): its first row among the
    # chunk's masked rows and log2 of its row size (0 and -1 for an always-synced slot: one coefficient for it).
    row_first: Tensor
    row_shift: Tensor
    always_at: Tensor  # per always-synced slot, on the device, its first element counted from the chunk's start
    params: list[Tensor]  # per slot its parameter: the step's lists of them, built once
    contiguous: bool  # every parameter contiguous, as the fused passes (compiled or Triton) read them
    one_dtype: bool  # every parameter of one dtype, as the Triton kernels read them
    # Views, built once (so a step dispatches no per-tensor view): per slot its m, v and direction (the work
    # buffer's direction space), shaped like it, in lists that hold their addresses for the Triton kernels; per
    # masked slot its direction's rows and its rows' coefficients (a column of the coefficient buffer, which holds
    # the chunk's masked rows from its first).
    exp_avgs: FixedAddresses
    exp_avg_sqs: FixedAddresses
    directions: FixedAddresses
    direction_rows: list[Tensor]
    coefs: list[Tensor]

    @property
    def padded(self) -> int:
        """Elements of the chunk's extent rounded up to `_ALIGN`: its row views' length."""
        return _aligned(self.end - self.start)


class Layout:
    """SLAMB's placement over the shared flat engine (`optim.flat`): m and v (fp32) in one `FlatState`, the scaled
    freshness (one value per row) in another over the rows of the same layout, each parameter's state a view into
    them; the work buffers; and every view a step needs (per tensor), built once.

    Order: param group by param group, always-synced tensors first, cut into chunks of whole tensors (`flat.runs`:
    the layout's buckets, stepped one after the other); inside a chunk the always-synced tensors, then the masked
    ones by row size, so that each chunk's always-synced coordinates are one slice and its masked ones another;
    chunks and masked tensors start at multiples of `_ALIGN` elements.
    """

    def __init__(self, param_groups: list[dict[str, Any]], state: dict, min_compress_numel: int, mask: str,
                 k: float, beta3: float, freshness_dtype: torch.dtype, product: bool) -> None:
        params = [p for g in param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"SLAMB needs all parameters on one device, got {sorted(map(str, devices))}")
        self.device = device = devices.pop()
        self.geometry = geometry_of(device)
        self.params = params
        groups = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
        always = [_always(p, min_compress_numel) for p in params]
        sizes = [row_size(mask, p.numel()) for p in params]
        # Always-synced tensors first in each group (stable): the order chunks are cut in, and each tensor's index.
        order = sorted(range(len(params)), key=lambda i: (groups[i], not always[i]))
        align = [1 if a else _ALIGN for a in always]
        chunks = [sorted(run, key=lambda i: (not always[i], 0 if always[i] else sizes[i]))  # masked by row size
                  for run in runs(order, [p.numel() for p in params], groups, self.geometry.chunk_numel, align)]
        self.flat_layout = FlatLayout.packed([p.shape for p in params], groups, chunks, _aligned, align)
        rows = self.flat_layout.rows(sizes, always)
        index = {i: position for position, i in enumerate(order)}
        self.slots_in_group_order = [
            Slot(p, placed.offset, p.numel(), always[i], index[i], sizes[i], row.offset)
            for i, (p, placed, row) in enumerate(zip(params, self.flat_layout.slots, rows.slots, strict=True))]
        self.numel = self.flat_layout.numel

        self.moments = FlatState(self.flat_layout, device, torch.float32)
        self.exp_avg = self.moments.add("exp_avg", params, state)
        self.exp_avg_sq = self.moments.add("exp_avg_sq", params, state)
        # r = beta3^(t mod R) q: q is rescaled once every R steps instead of r decaying every step (one pass
        # saved), and q is exact to fp16's 2^-11 at each write, with no error carried from step to step.
        self.rebase_interval = rebase_interval(beta3)
        self.rows = FlatState(rows, device, freshness_dtype)
        self.scaled_freshness = self.rows.add("scaled_freshness", params, state, fill=1.0)
        members = [[i for i in bucket if params[i].numel()] for bucket in self.flat_layout.members()]
        members = [bucket for bucket in members if bucket]  # an empty tensor needs no step
        placed = [[self.slots_in_group_order[i] for i in bucket] for bucket in members]
        self.slots = [s for slots in placed for s in slots]
        # The work buffer, kept between steps (a fresh allocation would be page-faulted in again every step): one
        # chunk's `Scratch` at a time, the chunk's direction and, after it, its coordinates of S_t.
        self.work = torch.empty(max((_scratch_numel(slots, [mask_size(mask, s, k) for s in slots if not s.always])
                                     for slots in placed), default=0), device=device)
        # The update's coefficients of one chunk's masked rows (one per coordinate for single-coordinate rows), and
        # the product form's second factor.
        largest = max((_masked_rows(slots) for slots in placed), default=0)
        self.coef = torch.empty(largest, device=device)
        self.spare = torch.empty(largest if product else 0, device=device)
        exp_avgs, exp_avg_sqs = self.moments.views("exp_avg"), self.moments.views("exp_avg_sq")
        self.chunks = [self._chunk(groups[bucket[0]], slots, [exp_avgs[i] for i in bucket],
                                   [exp_avg_sqs[i] for i in bucket], device)
                       for bucket, slots in zip(members, placed, strict=True)]

    def _chunk(self, group: int, slots: list[Slot], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               device: torch.device) -> Chunk:
        start, split, end = slots[0].offset, _split(slots), slots[-1].offset + slots[-1].numel
        masked = tuple(s for s in slots if not s.always)
        spans: list[Span] = []
        bases: list[int] = []
        for j, s in enumerate(masked):
            if spans and spans[-1].row_size == s.row_size:
                last = spans[-1]
                spans[-1] = Span(s.row_size, last.start, s.offset + s.numel - start, last.row, (last.slots[0], j + 1))
            else:
                spans.append(Span(s.row_size, s.offset - start, s.offset + s.numel - start, s.row, (j, j + 1)))
            bases.append(s.row - spans[-1].row)
        rows = (slots[0].row, masked[0].row if masked else slots[-1].row + slots[-1].rows,
                slots[-1].row + slots[-1].rows)
        ends = [s.row for s in masked[1:]] + [rows[2]] if masked else []

        def column(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return Chunk(
            group, start, split, end, tuple(slots), masked,
            one_d=torch.tensor([s.param.dim() <= 1 for s in slots], device=device),
            spans=tuple(spans), bases=tuple(bases), rows=rows,
            always_numels=column([s.numel for s in slots if s.always]),
            masked_at=column([at for at, s in enumerate(slots) if not s.always]),
            row_counts=column([e - s.row for s, e in zip(masked, ends, strict=True)]),
            row_first=column([0 if s.always else s.row - rows[1] for s in slots]),
            row_shift=column([-1 if s.always else s.row_size.bit_length() - 1 for s in slots]),
            always_at=column([s.offset - start for s in slots if s.always]),
            params=[s.param for s in slots], contiguous=all(s.param.is_contiguous() for s in slots),
            one_dtype=len({s.param.dtype for s in slots}) == 1,
            exp_avgs=FixedAddresses(exp_avgs), exp_avg_sqs=FixedAddresses(exp_avg_sqs),
            directions=FixedAddresses([s.flat(self.work, start).view_as(s.param) for s in slots]),
            direction_rows=[s.flat(self.work, start).view(-1, s.row_size) for s in masked],
            coefs=[self.coef[s.row - rows[1]:s.row - rows[1] + s.rows].view(-1, 1) for s in masked])

    def per_row(self, chunk: Chunk, per_slot: Tensor) -> Tensor:
        """Per-slot values (one row of `per_slot` per slot of the chunk) spread over the chunk's masked rows
        (padding rows take the values of the slot before them): two ops, however many slots."""
        return torch.repeat_interleave(per_slot.index_select(0, chunk.masked_at), chunk.row_counts, dim=0,
                                       output_size=chunk.rows[2] - chunk.rows[1])

    def load_(self, state: dict, saved: dict[str, list], beta3: float, step: int) -> None:
        """Copy saved m, v and freshness (`flat.pop_flat_entries`' lists, by parameter) into the flat buffers in
        place, chunk by chunk (`FlatState.load_`), and point `state` at them again.

        Freshness written by earlier versions is converted first, one tensor at a time: fp32 r ("freshness",
        before q) is q / synced_value, and q written per coordinate (constant over each row) is read row by row.
        """
        scaled = list(saved["scaled_freshness"])
        for i, (slot, r) in enumerate(zip(self.slots_in_group_order, saved["freshness"], strict=True)):
            if r is not None:
                scaled[i] = r * self.synced_value(beta3, step)
            if scaled[i] is not None and scaled[i].numel() == slot.numel != slot.rows:
                scaled[i] = scaled[i].reshape(-1)[::slot.row_size]
        for buffers, key, values in ((self.moments, "exp_avg", saved["exp_avg"]),
                                     (self.moments, "exp_avg_sq", saved["exp_avg_sq"]),
                                     (self.rows, "scaled_freshness", scaled)):
            buffers.load_(key, values)
            buffers.expose(key, self.params, state)

    def synced_value(self, beta3: float, step: int) -> float:
        """q of a coordinate synced at `step`: beta3^-(step mod R) as stored (rounded to the buffer's dtype)."""
        code = _STRUCT_CODES[self.scaled_freshness.dtype]
        return struct.unpack(code, struct.pack(code, beta3 ** -(step % self.rebase_interval)))[0]

    def state_bytes(self) -> int:
        """Bytes of m, v and the freshness."""
        return self.moments.nbytes() + self.rows.nbytes()

    def scratch(self, chunk: Chunk, mask: Mask) -> Scratch:
        """The work buffer's parts for stepping `chunk` with `mask`."""
        a, n = chunk.split - chunk.start, sum(mask.sizes)
        parts = self.work[:_scratch_numel(chunk.slots, mask.sizes)].split([chunk.padded, a + n, a + n, n, n])
        return Scratch(*parts)

    @staticmethod
    def region(buffer: Tensor, chunk: Chunk) -> Tensor:
        """The chunk's part of a flat buffer, padded: what its masks' rows index."""
        return buffer[chunk.start:chunk.start + chunk.padded]

    def gather_weights(self, chunk: Chunk, mask: Mask, out: Tensor, staged: bool, direct: bool = False) -> None:
        """out <- the masked weights at the selected coordinates (in fp32).

        The weights are separate tensors. When the direction space holds them (`staged`), or where each call costs
        host time (a GPU), they are gathered by one row gather per row size from the direction space, where they
        are copied in fp32 by one foreach copy unless they are there already. On a CPU calls are cheap and that
        copy, a pass over every masked weight, is not (about 10 % of a BERT-base step): unless staged, each
        tensor's rows are gathered from it directly, as they are anywhere when `direct` (a compiled step, whose
        passes are bound by memory, not by calls).
        """
        if not chunk.masked:
            return
        if staged or not (direct or self.geometry.per_tensor):
            direction = self.work[:chunk.padded]
            if not staged:
                always = len(chunk.slots) - len(chunk.masked)
                torch._foreach_copy_(chunk.directions[always:], chunk.params[always:])
            mask.select(direction, out)
            return
        parts = out.split(mask.sizes)
        rows = mask.rows.split([size // s.row_size for s, size in zip(chunk.masked, mask.sizes, strict=True)])
        for slot, base, part, selected in zip(chunk.masked, chunk.bases, parts, rows, strict=True):
            weights = slot.param.detach().reshape(-1, slot.row_size).float()
            torch.index_select(weights, 0, selected - base, out=part.view(-1, slot.row_size))

    def gather(self, chunk: Chunk, mask: Mask, out: Tensor) -> None:
        """out <- m at the chunk's synced coordinates: always-synced ones first, then the masked slots' rows."""
        always = chunk.split - chunk.start
        out[:always].copy_(self.exp_avg[chunk.start:chunk.split])
        mask.select(self.exp_avg[chunk.start:chunk.start + chunk.padded], out[always:])

    def scatter(self, chunk: Chunk, mask: Mask, values: Tensor) -> None:
        """The inverse of `gather`: m at the synced coordinates <- the averaged values."""
        always = chunk.split - chunk.start
        self.exp_avg[chunk.start:chunk.split].copy_(values[:always])
        mask.put(self.exp_avg[chunk.start:chunk.start + chunk.padded], values[always:])

    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.work, self.coef, self.spare))


@dataclass(frozen=True)
class Scratch:
    """One chunk's parts of the work buffer: its `direction` (padded, as its row views need); at S_t, laid out as
    the `compact` vector of its momentum (always-synced coordinates, then the masked slots' selected rows: what
    is all-reduced), the Adam `denominators` sqrt(v) + eps'; at the masked slots' selected rows their `weights`
    and their `fresh` direction."""

    direction: Tensor
    compact: Tensor
    denominators: Tensor
    weights: Tensor
    fresh: Tensor


def _scratch_numel(slots: Sequence[Slot], sizes: Sequence[int]) -> int:
    """Elements of the `Scratch` of a chunk of `slots`, `sizes` coordinates of S_t in its masked ones."""
    always = _split(list(slots)) - slots[0].offset
    return _aligned(slots[-1].offset + slots[-1].numel - slots[0].offset) + 2 * always + 4 * sum(sizes)


def _split(slots: list[Slot]) -> int:
    """The end of a chunk's always-synced slots (its start if none)."""
    return max((s.offset + s.numel for s in slots if s.always), default=slots[0].offset)


def _masked_rows(slots: list[Slot]) -> int:
    """Freshness rows of a chunk's masked slots, padding rows between them included."""
    masked = [s for s in slots if not s.always]
    return slots[-1].row + slots[-1].rows - masked[0].row if masked else 0


def _aligned(n: int) -> int:
    """n rounded up to a multiple of `_ALIGN`."""
    return -(-n // _ALIGN) * _ALIGN


def _always(p: Tensor, min_compress_numel: int) -> bool:
    return p.dim() <= 1 or p.numel() < min_compress_numel


def rebase_interval(beta3: float) -> int:
    """R, the steps between rescalings of the scaled freshness q: the largest with beta3^-(R-1) <= 2^15, so that
    q (at most beta3^-(t mod R)) stays in fp16's range; 1 for beta3 = 0 (then r = q), at most 2^16."""
    if beta3 <= 0.0:
        return 1
    if beta3 >= 1.0:
        return 1 << 16
    return min(1 << 16, int(15 * math.log(2.0) / -math.log(beta3)) + 1)
