"""Where tensors sit in one flat vector: slots, buckets, segments and chunks, computed once, read by every step.

- slot: one tensor's place (offset, shape, param group), listed in parameter order.
- bucket: elements [start, end) that travel as one vector; slots fill [start, stop), [stop, end) is padding
  (the 1-bit all-reduce pads each bucket to whole bytes per rank).
- segment: a maximal run of adjacent slots of one param group inside one bucket: math with a group's
  hyper-parameters runs as one op per segment, however many tensors it holds.
- chunk: at most `limit` elements of one segment, its slots cut where they cross its ends (pieces): passes that
  need a temporary, or that should stay in a CPU cache, run chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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
               padded: Callable[[int], int] | None = None) -> FlatLayout:
        """Tensors end to end, bucket by bucket: `buckets` lists the tensor indices of each (default: all in one),
        and each bucket of `size` elements takes `padded(size)` (default: `size`)."""
        indices = [list(b) for b in buckets] if buckets is not None else [list(range(len(shapes)))]
        slots: list[Slot | None] = [None] * len(shapes)
        placed, offset = [], 0
        for members in indices:
            start = offset
            for i in members:
                slots[i] = Slot(offset, torch.Size(shapes[i]), groups[i])
                offset += slots[i].numel
            end = start + (padded(offset - start) if padded is not None else offset - start)
            placed.append(Bucket(start, offset, end))
            offset = end
        if any(s is None for s in slots):
            raise ValueError("FlatLayout.packed: every tensor must be in one bucket")
        return cls(slots, placed)  # type: ignore[arg-type]

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
