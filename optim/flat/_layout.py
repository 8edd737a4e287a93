"""Where tensors sit in one flat vector: slots, buckets, segments and chunks, computed once, read by every step.

- slot: one tensor's place (offset, shape, param group), listed in parameter order.
- bucket: elements [start, end) that travel (or are stepped) as one vector; slots fill [start, stop), [stop, end)
  is padding (the 1-bit all-reduce pads each bucket to whole bytes per rank). `runs` cuts a list of tensors into
  buckets of whole tensors.
- segment: a maximal run of adjacent slots of one param group inside one bucket: math with a group's
  hyper-parameters runs as one op per segment, however many tensors it holds.
- chunk: at most `limit` elements of one segment, its slots cut where they cross its ends (pieces): passes that
  need a temporary, or that should stay in a CPU cache, run chunk by chunk.
- rows (`FlatLayout.rows`): a second layout with one element per row of consecutive elements of each slot, for
  state that a row shares (SLAMB's freshness), placed so that one row index addresses both.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from optim._math import FOREACH_CHUNK_NUMEL


@dataclass(frozen=True)
class Slot:
    """One tensor's place: `shape.numel()` elements from `offset`, of param group `group`."""

    offset: int
    shape: torch.Size
    group: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Bucket:
    """Elements [start, end) sent as one vector: slots in [start, stop), padding in [stop, end)."""

    start: int
    stop: int
    end: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Piece:
    """Elements [lo, hi) of slot `slot` (its whole tensor when `whole`)."""

    slot: int
    lo: int
    hi: int
    whole: bool

    def of(self, tensor: Tensor) -> Tensor:
        """This piece of a tensor shaped like the slot's: the tensor itself when whole (no op), else a 1-D view."""
        return tensor if self.whole else tensor.view(-1)[self.lo:self.hi]


@dataclass(frozen=True)
class Chunk:
    """Elements [start, stop) of one segment, of param group `group`; `pieces` are its slots' parts in order."""

    group: int
    start: int
    stop: int
    pieces: tuple[Piece, ...]


class FlatLayout:
    """Slots in one flat vector of `numel` elements, with its buckets, segments and chunks.

    `slots` are in parameter order (index i is the i-th parameter of the param groups) and must not overlap;
    `buckets` cover them (default: one bucket over all, unpadded). Build the common case with `packed`; an
    optimizer with its own placement (alignment, an order by kind) passes its slots directly.
    """

    def __init__(self, slots: Sequence[Slot], buckets: Sequence[Bucket] | None = None) -> None:
        self.slots = list(slots)
        by_offset = sorted(range(len(self.slots)), key=lambda i: self.slots[i].offset)
        end = max((s.stop for s in self.slots), default=0)
        self.buckets = list(buckets) if buckets is not None else [Bucket(0, end, end)] if self.slots else []
        self.numel = max((b.end for b in self.buckets), default=end)
        self.segments = _segments(self.slots, by_offset, self.buckets)
        self._by_offset = by_offset
        self._chunks: dict[int | None, list[Chunk]] = {}

    @classmethod
    def packed(cls, shapes: Sequence[torch.Size], groups: Sequence[int], buckets: Sequence[Sequence[int]] | None = None,
               padded: Callable[[int], int] | None = None, align: Sequence[int] | None = None) -> FlatLayout:
        """Tensors end to end, bucket by bucket: `buckets` lists the tensor indices of each in the order they are
        placed (default: all in one), each bucket of `size` elements takes `padded(size)` (default: `size`), and
        tensor i starts at a multiple of `align[i]` elements (default: 1, no gap)."""
        indices = [list(b) for b in buckets] if buckets is not None else [list(range(len(shapes)))]
        slots: list[Slot | None] = [None] * len(shapes)
        placed, offset = [], 0
        for members in indices:
            start = offset
            for i in members:
                offset = _round_up(offset, align[i]) if align is not None else offset
                slots[i] = Slot(offset, torch.Size(shapes[i]), groups[i])
                offset += slots[i].numel
            end = start + (padded(offset - start) if padded is not None else offset - start)
            placed.append(Bucket(start, offset, end))
            offset = end
        if any(s is None for s in slots):
            raise ValueError("FlatLayout.packed: every tensor must be in one bucket")
        return cls(slots, placed)  # type: ignore[arg-type]

    def rows(self, row_sizes: Sequence[int], kinds: Sequence[Hashable]) -> FlatLayout:
        """A layout with one element per row of each slot (`row_sizes[i]` consecutive elements of slot i, which
        its size and, in a run, its offset from the run's first must be multiples of): state that a row shares.

        Inside a run (consecutive slots of one kind and one row size inside one bucket) rows keep the elements'
        spacing, so that a row index relative to the run addresses a row of elements and its value alike (an
        alignment gap becomes padding rows); runs follow each other with no gap. Slots keep their param groups;
        each bucket becomes the rows of its slots.
        """
        slots: list[Slot | None] = [None] * len(self.slots)
        buckets, row = [], 0
        for members in self.members():
            start, run = row, None
            for i in members:
                slot, size = self.slots[i], row_sizes[i]
                if run is None or run[:2] != (kinds[i], size):
                    run = (kinds[i], size, slot.offset, row)
                first = run[3] + (slot.offset - run[2]) // size
                slots[i] = Slot(first, torch.Size((slot.numel // size,)), slot.group)
                row = first + slot.numel // size
            buckets.append((start, row))
        return FlatLayout(slots, [Bucket(a, b, b) for a, b in buckets])  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------------------------- views
    def views(self, flat: Tensor) -> list[Tensor]:
        """Per slot, its view of `flat` (a vector of `numel` elements), shaped like its tensor."""
        return [flat[s.offset:s.stop].view(s.shape) for s in self.slots]

    def segment_views(self, flat: Tensor) -> list[tuple[int, Tensor]]:
        """(param group, 1-D view) per segment of `flat`."""
        return [(group, flat[a:b]) for group, a, b in self.segments]

    def bucket_views(self, flat: Tensor) -> list[Tensor]:
        """Per bucket, its padded 1-D view of `flat`."""
        return [flat[b.start:b.end] for b in self.buckets]

    def members(self) -> list[list[int]]:
        """Per bucket, its slots (indices) in offset order: for a pass that steps a bucket of whole tensors."""
        starts = [b.start for b in self.buckets]
        members: list[list[int]] = [[] for _ in self.buckets]
        for i in self._by_offset:
            members[bisect.bisect_right(starts, self.slots[i].offset) - 1].append(i)
        return members

    # ---------------------------------------------------------------------------------------------- chunks
    def chunks(self, limit: int | None) -> list[Chunk]:
        """The segments cut into chunks of at most `limit` elements (None: one chunk per segment), a slot that
        crosses a cut into pieces. The same every call (computed once per limit)."""
        if limit not in self._chunks:
            self._chunks[limit] = [chunk for group, a, b in self.segments
                                   for chunk in self._cut(group, a, b, limit or max(b - a, 1))]
        return self._chunks[limit]

    def _cut(self, group: int, start: int, stop: int, limit: int) -> list[Chunk]:
        inside = [i for i in self._by_offset if start <= self.slots[i].offset < stop]
        chunks = []
        for a in range(start, stop, limit):
            b = min(a + limit, stop)
            pieces = []
            for i in inside:
                slot = self.slots[i]
                lo, hi = max(a, slot.offset) - slot.offset, min(b, slot.stop) - slot.offset
                if lo < hi:
                    pieces.append(Piece(i, lo, hi, lo == 0 and hi == slot.numel))
            chunks.append(Chunk(group, a, b, tuple(pieces)))
        return chunks


def runs(order: Sequence[int], numels: Sequence[int], groups: Sequence[int], limit: int | None,
         align: Sequence[int] | None = None) -> list[list[int]]:
    """`order` (tensor indices) cut into consecutive runs of one param group whose extent, packed as
    `FlatLayout.packed` places them (tensor i at a multiple of `align[i]`), is at most `limit` elements (None: a
    whole group; a larger tensor: a run of its own): buckets of whole tensors, to step one after the other."""
    cut: list[list[int]] = []
    extent = 0
    for i in order:
        grown = (_round_up(extent, align[i]) if align is not None else extent) + numels[i]
        if not cut or groups[cut[-1][-1]] != groups[i] or (limit is not None and grown > limit):
            cut.append([])
            grown = numels[i]
        cut[-1].append(i)
        extent = grown
    return cut


def foreach_chunks(tensors: Sequence[Tensor], max_numel: int | None = None) -> list[slice]:
    """`runs` of a plain tensor list, as slices: consecutive tensors holding at most `max_numel` elements each (a
    larger tensor: alone), by default the chunk size of their device type (`FOREACH_CHUNK_NUMEL`), for the
    multi-tensor passes of the optimizers that keep no flat state."""
    if max_numel is None and tensors:
        max_numel = FOREACH_CHUNK_NUMEL.get(tensors[0].device.type)
    cut = runs(range(len(tensors)), [t.numel() for t in tensors], [0] * len(tensors), max_numel)
    return [slice(run[0], run[-1] + 1) for run in cut] or [slice(0, 0)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _segments(slots: list[Slot], by_offset: list[int], buckets: list[Bucket]) -> list[tuple[int, int, int]]:
    """(group, start, stop) of each maximal run of adjacent slots of one group inside one bucket."""
    segments: list[tuple[int, int, int]] = []
    bucket = 0
    for i in by_offset:
        slot = slots[i]
        while buckets and slot.offset >= buckets[bucket].stop:
            bucket += 1
        last = segments[-1] if segments else None
        if last is not None and last[0] == slot.group and last[2] == slot.offset and last[1] >= buckets[bucket].start:
            segments[-1] = (slot.group, last[1], slot.stop)
        else:
            segments.append((slot.group, slot.offset, slot.stop))
    return segments
