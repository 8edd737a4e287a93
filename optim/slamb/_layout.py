"""SLAMB's flat buffers: m, v and the freshness of every parameter in three flat tensors, and the views a step uses.

A step's cost on a GPU is its number of dispatched ops, so every per-tensor quantity a step needs is laid out
once here, and a step works on a few large slices instead of one tensor at a time. Terms:

- slot: one parameter's place in the flat buffers (offset, size, row size, first freshness row).
- row: `row_size` consecutive coordinates of a masked tensor (up to 16, see `_masks.row_size`), which the
  mask selects together; they share one freshness value, so the freshness buffer holds one value per row.
- chunk: consecutive slots of one param group, at most `_CHUNK_NUMEL` elements, stepped one after the other:
  always-synced slots first, then the masked ones grouped by row size.
- span: a chunk's masked slots of one row size, consecutive in the buffers, so that one row view of a buffer
  (and of the freshness) serves all of them.
- piece: elements [a, b) of one slot, the unit of the foreach passes: the whole tensor, or on a CPU a
  cache-sized part of it.
- foreach group: pieces processed by one set of foreach calls (on a CPU, at most `_PIECE_NUMEL` elements).
- segment: the pieces of one row size within a GPU update group (a span's part in it).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from optim.slamb._masks import ROW_NUMEL, Mask, mask_size, row_size

# Elements per chunk of the flat buffers, by device type (absent: a whole param group). On the CPU the passes
# of one chunk stay in cache (see optim._math's FOREACH_CHUNK_NUMEL); on a GPU it bounds the scratch buffer
# (a tensor larger than the limit forms a chunk of its own).
_CHUNK_NUMEL = {"cpu": 1 << 20, "cuda": 1 << 26}
# Elements per piece of the moments' and the update's passes, by device type (absent: a whole tensor). On the CPU
# a piece stays in cache between the passes that form and use it; on a GPU, pieces would only multiply the kernel
# launches (BERT-Large: about 10,000 more per step, the step's whole cost), so each tensor is one piece.
_PIECE_NUMEL = {"cpu": 1 << 18}
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
class Piece:
    """Elements [a, b) of one slot."""

    slot: Slot
    at: int  # the slot's position in its chunk
    a: int
    b: int

    @property
    def whole(self) -> bool:
        return self.a == 0 and self.b == self.slot.numel

    def of(self, tensor: Tensor) -> Tensor:
        """This piece of the parameter or of a tensor shaped like it (a whole one as it is: no op)."""
        return tensor if self.whole else tensor.view(-1)[self.a:self.b]

    def view(self, buffer: Tensor, start: int) -> Tensor:
        """This piece of a flat buffer whose element 0 is flat position `start`, shaped as `of` shapes it."""
        flat = buffer[self.slot.offset + self.a - start:self.slot.offset + self.b - start]
        return flat.view_as(self.slot.param) if self.whole else flat

    @property
    def rows(self) -> tuple[int, int]:
        """Its [first, last) rows in the freshness buffer (pieces start at multiples of the row size)."""
        return self.slot.row + self.a // self.slot.row_size, self.slot.row + self.b // self.slot.row_size


@dataclass(frozen=True)
class ForeachGroup:
    """Pieces with their views of the flat buffers (built once, so a step dispatches no per-tensor view);
    [start, end) is the flat extent they cover, [first, last) their freshness rows."""

    pieces: tuple[Piece, ...]
    start: int
    end: int
    first: int
    last: int
    views: dict[str, list[Tensor]]
    # (row size, first element, end element, first row, end row) relative to the group, per segment (an update
    # group of a GPU layout only: see `Layout._update_group`).
    segments: tuple[tuple[int, int, int, int, int], ...] = ()


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
    directions: list[Tensor]  # per slot, its view of the direction space (the work buffer), shaped like it
    moments: tuple[ForeachGroup, ...]  # every slot: the passes over m, v, g and the direction
    updates: tuple[ForeachGroup, ...]  # the masked slots: the coefficient and update passes

    @property
    def padded(self) -> int:
        """Elements of the chunk's extent rounded up to `_ALIGN`: its row views' length."""
        return _aligned(self.end - self.start)


class Layout:
    """Flat buffers for m, v (fp32) and the scaled freshness, each parameter's state a view into them; work buffers.

    Order: param group by param group, always-synced tensors first, so that each chunk's always-synced
    coordinates are one slice and its masked ones another; chunks and masked tensors start at multiples of
    `_ALIGN` elements. Every view a step needs of these buffers (per tensor or piece) is built here, once.
    """

    def __init__(self, param_groups: list[dict[str, Any]], state: dict, min_compress_numel: int, mask: str,
                 k: float, beta3: float, freshness_dtype: torch.dtype, step: int, product: bool) -> None:
        params = [p for g in param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"SLAMB needs all parameters on one device, got {sorted(map(str, devices))}")
        self.device = device = devices.pop()
        placed = self._place(param_groups, min_compress_numel, mask, _CHUNK_NUMEL.get(device.type))
        self.slots: list[Slot] = [s for _, slots in placed for s in slots]
        by_param = {id(s.param): s for s in self.slots}
        self.slots_in_group_order = [by_param[id(p)] for p in params]
        self.numel = _aligned(max((s.offset + s.numel for s in self.slots), default=0))

        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # r = beta3^(t mod R) q: q is rescaled once every R steps instead of r decaying every step (one pass
        # saved), and q is exact to fp16's 2^-11 at each write, with no error carried from step to step.
        self.rebase_interval = rebase_interval(beta3)
        rows = max((s.row + s.rows for s in self.slots), default=0)  # one per row of the masks
        self.scaled_freshness = torch.ones(rows, dtype=freshness_dtype, device=device)
        # Work buffers, kept between steps (a fresh allocation would be page-faulted in again every step).
        # One buffer serves, in turn, as the compact vector (about k d: the momenta that are all-reduced) and,
        # once they are back in m, as each chunk's work space: its masked weights (to gather them), then its
        # direction, with the direction and the weights gathered at its selected coordinates after it.
        compact = sum(_split(slots) - slots[0].offset + sum(mask_size(mask, s, k) for s in slots if not s.always)
                      for _, slots in placed)
        work = max((_aligned(slots[-1].offset + slots[-1].numel - slots[0].offset)
                    + 2 * sum(mask_size(mask, s, k) for s in slots if not s.always) for _, slots in placed),
                   default=0)
        self.work = torch.empty(max(compact, work), device=device)
        self.compact = self.work[:compact]
        self.piece_numel = _PIECE_NUMEL.get(device.type)
        updates = [_pieces([(at, s) for at, s in enumerate(slots) if not s.always], self.piece_numel)
                   for _, slots in placed]
        largest = max((pieces[-1].rows[1] - pieces[0].rows[0] for groups in updates for pieces in groups), default=0)
        self.coef = torch.empty(largest, device=device)  # the coefficients of one group of `updates`, per row
        self.spare = torch.empty(largest if product else 0, device=device)  # the product form's second factor
        widest = max((_extent(pieces)[1] - _extent(pieces)[0] for groups in updates for pieces in groups), default=0)
        # A GPU layout spreads the coefficients over the coordinates of one group of `updates`
        self.spread = torch.empty(widest if self.piece_numel is None else 0, device=device)
        self.chunks = [self._chunk(gi, slots, groups, device) for (gi, slots), groups in zip(placed, updates,
                                                                                             strict=True)]
        self.adopt(state, beta3, step)

    @staticmethod
    def _place(param_groups: list[dict[str, Any]], min_compress_numel: int, mask: str,
               limit: int | None) -> list[tuple[int, list[Slot]]]:
        """The slots, cut into chunks of at most `limit` elements: (param group, slots) per chunk.

        A chunk holds its always-synced slots, then its masked ones by row size (stable), each masked one at a
        multiple of `_ALIGN`. The freshness buffer holds the slots' rows in the same order, a masked slot's first
        row as far (in rows) from its span's as its first element (so one span-relative row index serves both).
        """
        members: list[tuple[int, list[tuple[Tensor, int]]]] = []  # (param group, [(param, index)]) per chunk
        index = 0
        for gi, group in enumerate(param_groups):
            current: list[tuple[Tensor, int]] = []
            size = 0
            for p in sorted(group["params"], key=lambda p: not _always(p, min_compress_numel)):  # stable
                grown = (size if _always(p, min_compress_numel) else _aligned(size)) + p.numel()
                if current and limit is not None and grown > limit:
                    members.append((gi, current))
                    current, grown = [], p.numel()
                current.append((p, index))
                size, index = grown, index + 1
            if current:
                members.append((gi, current))
        chunks: list[tuple[int, list[Slot]]] = []
        offset, row = 0, 0
        for gi, current in members:
            offset, slots = _aligned(offset), []
            for p, i in current:
                if _always(p, min_compress_numel):
                    slots.append(Slot(p, offset, p.numel(), True, i, row_size(mask, p.numel()), row))
                    offset, row = offset + p.numel(), row + slots[-1].rows
            masked = sorted(((p, i) for p, i in current if not _always(p, min_compress_numel)),
                            key=lambda pair: row_size(mask, pair[0].numel()))
            for p, i in masked:
                size, offset = row_size(mask, p.numel()), _aligned(offset)
                if not slots or slots[-1].always or slots[-1].row_size != size:  # a new span: its first row
                    span_offset, span_row = offset, row
                slots.append(Slot(p, offset, p.numel(), False, i, size, span_row + (offset - span_offset) // size))
                offset = offset + p.numel()
                row = span_row + (offset - span_offset) // size
            chunks.append((gi, slots))
        return chunks

    def _chunk(self, group: int, slots: list[Slot], updates: list[list[Piece]], device: torch.device) -> Chunk:
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
        moments = [self._group(pieces, {"m": self.exp_avg, "v": self.exp_avg_sq}, start)
                   for pieces in _pieces(list(enumerate(slots)), self.piece_numel)]
        return Chunk(
            group, start, split, end, tuple(slots), masked,
            one_d=torch.tensor([s.param.dim() <= 1 for s in slots], device=device),
            spans=tuple(spans), bases=tuple(bases), rows=rows,
            directions=[s.flat(self.work, start).view_as(s.param) for s in slots], moments=tuple(moments),
            updates=tuple(self._update_group(pieces, start) for pieces in updates))

    def _group(self, pieces: list[Piece], buffers: dict[str, Tensor], start: int) -> ForeachGroup:
        """A group with its pieces' views of the flat `buffers` and of the work space (whose element 0 is the
        chunk's first, flat position `start`) as "direction"."""
        views = {name: [piece.view(buffer, 0) for piece in pieces] for name, buffer in buffers.items()}
        views["direction"] = [piece.view(self.work, start) for piece in pieces]
        return ForeachGroup(tuple(pieces), *_extent(pieces), pieces[0].rows[0], pieces[-1].rows[1], views)

    def _update_group(self, pieces: list[Piece], start: int) -> ForeachGroup:
        """A group of masked pieces with "coef" (one coefficient per row, in the coefficient buffer from the
        group's first row) and "direction", the work space's rows (pieces of a CPU layout: the update broadcasts
        a row's coefficient over the row) or, in a GPU layout, shaped like the tensors, with "spread": the
        coefficients spread over the coordinates by one copy per segment, then one fused foreach update (a
        broadcasting foreach op would launch a kernel per tensor)."""
        first, last = pieces[0].rows[0], pieces[-1].rows[1]
        coefs = [self.coef[piece.rows[0] - first:piece.rows[1] - first].view(-1, 1) for piece in pieces]
        if self.piece_numel is not None:
            directions = [piece.view(self.work, start).view(-1, piece.slot.row_size) for piece in pieces]
            return ForeachGroup(tuple(pieces), *_extent(pieces), first, last, {"direction": directions, "coef": coefs})
        origin = _extent(pieces)[0]
        segments: list[tuple[int, int, int, int, int]] = []
        for piece in pieces:  # same-size rows of consecutive pieces are as far apart as their elements
            size = piece.slot.row_size
            a, b = piece.slot.offset + piece.a - origin, piece.slot.offset + piece.b - origin
            row_a, row_b = piece.rows[0] - first, piece.rows[1] - first
            if segments and segments[-1][0] == size:
                segments[-1] = (size, segments[-1][1], b, segments[-1][3], row_b)
            else:
                segments.append((size, a, b, row_a, row_b))
        views = {"direction": [piece.view(self.work, start) for piece in pieces], "coef": coefs,
                 "spread": [piece.view(self.spread, origin) for piece in pieces]}
        return ForeachGroup(tuple(pieces), *_extent(pieces), first, last, views, tuple(segments))

    def adopt(self, state: dict, beta3: float, step: int) -> None:
        """Copy any loaded m, v and freshness in `state` into the flat buffers, then point `state` at them.

        Freshness written per coordinate (before it was kept per row; constant over each row) is read row by row.
        """
        for slot in self.slots:
            entry = state[slot.param]
            if "freshness" in entry:  # written before q: fp32 r = q / synced_value
                entry["scaled_freshness"] = entry.pop("freshness") * self.synced_value(beta3, step)
            if "scaled_freshness" in entry and entry["scaled_freshness"].numel() == slot.numel != slot.rows:
                entry["scaled_freshness"] = entry["scaled_freshness"].reshape(-1)[::slot.row_size]
            views = {"exp_avg": self.view(self.exp_avg, slot), "exp_avg_sq": self.view(self.exp_avg_sq, slot),
                     "scaled_freshness": self.scaled_freshness[slot.row:slot.row + slot.rows]}
            for key, view in views.items():
                if key in entry:
                    if entry[key].shape != view.shape:
                        raise ValueError(f"SLAMB: loaded {key} of shape {tuple(entry[key].shape)} where this "
                                         f"parameter's is {tuple(view.shape)}")
                    view.copy_(entry[key])
                entry[key] = view

    def synced_value(self, beta3: float, step: int) -> float:
        """q of a coordinate synced at `step`: beta3^-(step mod R) as stored (rounded to the buffer's dtype)."""
        code = _STRUCT_CODES[self.scaled_freshness.dtype]
        return struct.unpack(code, struct.pack(code, beta3 ** -(step % self.rebase_interval)))[0]

    @staticmethod
    def view(buffer: Tensor, slot: Slot) -> Tensor:
        return slot.flat(buffer).view_as(slot.param)

    def selected(self, chunk: Chunk, mask: Mask) -> tuple[Tensor, Tensor]:
        """Where the direction and the weights at the selected coordinates go: the work space after the direction."""
        a, n = chunk.padded, sum(mask.sizes)
        return self.work[a:a + n], self.work[a + n:a + 2 * n]

    def gather_weights(self, chunk: Chunk, mask: Mask) -> None:
        """The masked weights at the selected coordinates, into `selected`'s second buffer.

        The weights are separate tensors. With whole-tensor pieces (a GPU, where each call costs host time) they
        are copied into the chunk's work space (one foreach copy, in fp32) and gathered by one row gather per row
        size for all the chunk's tensors. On a CPU calls are cheap and that copy, a pass over every masked
        weight, is not (about 10 % of a BERT-base step): each tensor's rows are gathered from it directly.
        """
        if not chunk.masked:
            return
        out = self.selected(chunk, mask)[1]
        if self.piece_numel is None:
            always = len(chunk.slots) - len(chunk.masked)
            torch._foreach_copy_(chunk.directions[always:], [s.param for s in chunk.masked])
            mask.select(self.work[:chunk.padded], out)
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
        return sum(t.numel() * t.element_size() for t in (self.work, self.coef, self.spare, self.spread))


def _split(slots: list[Slot]) -> int:
    """The end of a chunk's always-synced slots (its start if none)."""
    return max((s.offset + s.numel for s in slots if s.always), default=slots[0].offset)


def _extent(pieces: list[Piece]) -> tuple[int, int]:
    """The flat [start, end) that consecutive pieces cover."""
    return pieces[0].slot.offset + pieces[0].a, pieces[-1].slot.offset + pieces[-1].b


def _pieces(slots: Sequence[tuple[int, Slot]], piece_numel: int | None) -> list[list[Piece]]:
    """(position in the chunk, slot) pairs cut into foreach groups of at most `piece_numel` elements, a larger
    contiguous tensor into pieces of that size (a strided one stays whole); None: one group of whole tensors."""
    if piece_numel is None:
        return [[Piece(s, at, 0, s.numel) for at, s in slots]] if slots else []
    groups: list[list[Piece]] = []
    room = 0
    for at, s in slots:
        size = piece_numel if s.param.is_contiguous() else max(s.numel, 1)
        for a in range(0, s.numel, size):
            b = min(a + size, s.numel)
            if b - a > room:
                groups.append([])
                room = piece_numel
            groups[-1].append(Piece(s, at, a, b))
            room -= b - a
    return groups


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
