"""SLAMB's sync masks S_t: which rows of each masked tensor a step averages, drawn alike on every rank.

Every mask is a pure function of (seed, step), drawn from a private generator, and every length is known on the
host from the tensors' sizes alone, so that a step compacts, all-reduces and scatters the momentum without reading
anything from the device. The terms (slot, chunk, span, row) are the layout's (see `_layout`); a mask adds one:

- run: the part of one chunk's mask that falls in one span, i.e. the selected rows of that span's slots.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from optim._math import mask_seed
from optim.comm import Comm

if TYPE_CHECKING:
    from optim.slamb._layout import Chunk, Slot, Span

MASKS = ("stratified", "bernoulli", "cyclic")
ROW_NUMEL = 16  # coordinates per row of the stratified and cyclic masks: one 64-byte cache line of fp32


def row_size(mask: str, numel: int) -> int:
    """Coordinates per row of a masked tensor: up to 16 consecutive ones (one 64-byte cache line of fp32), the
    largest power of two dividing the tensor's size; single coordinates for Slamb_V2's Bernoulli mask."""
    return (min(ROW_NUMEL, numel & -numel) or 1) if mask != "bernoulli" else 1  # 1 for an empty tensor


def cyclic_parts(k: float) -> int:
    """n_c = floor(1 / k), the parts of the cyclic mask's fixed partition."""
    return max(1, math.floor(1.0 / k + 1e-9))


def mask_size(mask: str, slot: Slot, k: float) -> int:
    """Coordinates per step in one masked tensor's part of the compact vector (cyclic: the largest part)."""
    if mask == "cyclic":
        return -(-slot.rows // cyclic_parts(k)) * slot.row_size
    if mask == "stratified":
        return stratified_count(slot.rows, k) * slot.row_size
    return bernoulli_capacity(slot.numel, k)


def _draw_size(mask: str, slot: Slot, k: float) -> int:
    """Uniforms one masked tensor's draw takes: rows + 1 (stratified) or the Bernoulli capacity."""
    if mask == "stratified":
        return stratified_count(slot.rows, k) + 1
    return bernoulli_capacity(slot.numel, k)


# ------------------------------------------------------------------------------------------ samplers
def stratified_count(n: int, k: float) -> int:
    """How many of `n` rows `stratified_rows` selects: round(k n), at least 1 and at most n."""
    return min(n, max(1, round(k * n)))


def stratified_plan(tensors: Sequence[tuple[int, int, int, int]], device: torch.device) -> dict[str, Any]:
    """The constants of `stratified_rows`, built once for the tensors of one draw.

    `tensors` holds per tensor `(n, count, first, offset)`: `count` of its `n` rows are picked by the uniforms at
    [first, first + count) and rotated by the one at first + count; its rows are shifted by `offset` (its first
    row in a shared row space). Rows come out tensor by tensor, in the order of `tensors`. Everything but the
    rotation is fixed, so it is kept per pick (20 bytes, about 0.13 byte per coordinate for rows of 16 at
    k = 0.1): a step then costs a few passes over the picks. Written in place, tensor by tensor (no temporaries,
    no host read).
    """
    counts = [t[1] for t in tensors]
    picks = sum(counts)
    at, base, end, n_rows = (torch.empty(picks, dtype=torch.int32, device=device) for _ in range(4))
    length = torch.empty(picks, dtype=torch.float32, device=device)
    for (n, count, first, offset), a in zip(tensors, _starts(counts), strict=True):
        q, long = divmod(n, count)  # the first `long` strata have q + 1 rows, the others q
        split, b = a + long, a + count
        torch.arange(first, first + count, out=at[a:b])
        # stratum i starts at i (q + 1) among the long ones, at i q + long after them
        torch.arange(offset, offset + long * (q + 1), q + 1, out=base[a:split])
        torch.arange(offset + long * (q + 1), offset + n, q, out=base[split:b])
        length[a:split].fill_(q + 1)
        length[split:b].fill_(q)
        end[a:b].fill_(offset + n)
        n_rows[a:b].fill_(n)

    def column(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    return {"at": at, "length": length, "base": base, "end": end, "n": n_rows, "picks": picks,
            "rotation_at": column([t[2] + t[1] for t in tensors], torch.int64),
            "rotation_scale": column([t[0] for t in tensors], torch.float32),
            "count": column(counts, torch.int64)}


def stratified_rows(uniforms: Tensor, plan: dict[str, Any]) -> Tensor:
    """Exactly `count` distinct rows per tensor of `plan`: one uniformly in each of `count` strata, randomly rotated.

    The strata tile [0, n) with lengths q = n // count or q + 1 (the first n % count are the longer ones), and the
    whole pattern is rotated by a uniform offset, so that every row is selected with probability exactly count / n
    (unequal strata would otherwise favour the short ones). Masks of different steps use independent uniforms, so
    a coordinate's selections are independent across steps, as with per-coordinate Bernoulli draws; within a step
    the count is fixed (no host read to size the all-reduce) and selections are spread evenly. A fixed number of
    vectorised ops for all the tensors, integer arithmetic but for the two products with a uniform.
    """
    # the float32 products are those of the scalar form (lengths and n exact below 2^24); the cast floors them
    rotation = uniforms.index_select(0, plan["rotation_at"]).mul_(plan["rotation_scale"]).to(torch.int64)
    rows = uniforms.index_select(0, plan["at"]).mul_(plan["length"]).to(torch.int64).add_(plan["base"])
    rows.add_(torch.repeat_interleave(rotation, plan["count"], output_size=plan["picks"]))
    return torch.where(rows >= plan["end"], rows - plan["n"], rows)  # the rotation wraps within its tensor


def _starts(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive stretches of `sizes` elements starts."""
    return list(accumulate(sizes[:-1], initial=0)) if sizes else []


def bernoulli_capacity(n: int, k: float, sigmas: float = 8.0) -> int:
    """A bound on Binomial(n, k) exceeded with probability below 1e-15 (mean + 8 sigma + 16), at most n."""
    mean = n * k
    return min(n, math.ceil(mean + sigmas * math.sqrt(mean * (1.0 - k)) + 16))


def bernoulli_plan(tensors: Sequence[tuple[int, int, int]], device: torch.device) -> dict[str, Any]:
    """The per-tensor constants of `bernoulli_rows`, built once: `tensors` holds per tensor `(n, capacity,
    offset)`, drawn from consecutive stretches of `capacity` uniforms, its positions shifted by `offset`."""
    capacities = [t[1] for t in tensors]
    first = torch.tensor(_starts(capacities), dtype=torch.int64)
    n, offset = (torch.tensor([t[i] for t in tensors], dtype=torch.int64) for i in (0, 2))
    count = torch.tensor(capacities, dtype=torch.int64)
    plan = {"first": first, "shift": first - offset, "end": n + offset, "count": count}
    return {key: value.to(device) for key, value in plan.items()} | {"picks": sum(capacities)}


def bernoulli_rows(uniforms: Tensor, k: float, plan: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """`(positions, valid)`: each of [0, n) selected independently with probability k, padded to a fixed length,
    for every tensor of `plan` at once.

    The gaps between successive Bernoulli(k) successes are i.i.d. Geometric(k); drawing one gap per uniform
    (inverse CDF: floor(log(1 - U) / log(1 - k)) + 1) costs about k n random numbers instead of n. Their running
    sum within each tensor (one cumsum of all, minus its value before the tensor's first gap: integers, exact)
    gives the sorted positions. The capacity fixes the length (`bernoulli_capacity`): positions past n are
    padding, replaced by a copy of the tensor's first position (a duplicate carries the same value through a
    gather, all-reduce and scatter, so it changes nothing) and marked invalid (0) in `valid`, which keeps them
    out of norms. Two events change the mask, both with probability below 1e-15 per tensor and step at the
    default capacity, and both decided on the device: more successes than the capacity (the last ones are not
    selected this step) and no success at all (position n - 1 is selected).
    """
    total, first = plan["picks"], plan["first"]

    def spread(per_tensor: Tensor) -> Tensor:  # one value per tensor -> one per position
        return torch.repeat_interleave(per_tensor, plan["count"], output_size=total)

    rows = torch.arange(total, device=uniforms.device)  # position + offset = rows - shift within a tensor
    if k >= 1.0:
        return rows.sub_(spread(plan["shift"])), torch.ones(total, device=uniforms.device)
    # 1 - U lies in (0, 1], so its log is finite; log is vectorised where log1p is not (10x on the CPU).
    gaps = uniforms.neg().add_(1.0).log_().div_(math.log1p(-k)).to(torch.int64)
    sums = torch.zeros(total + 1, dtype=torch.int64, device=gaps.device)
    torch.cumsum(gaps, 0, out=sums[1:])
    # the gaps' running sum within the tensor, plus the position's index in it, plus the offset (exact integers)
    rows.add_(sums[1:]).sub_(spread(sums.index_select(0, first).add_(plan["shift"])))
    valid = (rows < spread(plan["end"])).index_fill_(0, first, True)
    first_rows = torch.minimum(rows.index_select(0, first), plan["end"] - 1)
    return torch.where(valid, rows, spread(first_rows)), valid.to(torch.float32)


def mask_uniforms(generator: torch.Generator, count: int, device: torch.device) -> Tensor:
    """`count` uniforms in [0, 1) from the host `generator`, on `device`: the same bits on every device.

    A CUDA generator maps its random stream to elements by the device's multiprocessor count, so ranks on
    different GPU models (or MIG slices) would draw different masks: compact vectors of different lengths (a
    hang) or unrelated coordinates averaged. The CPU generator's stream is serial (independent of threads and
    of how the draw is split). To a GPU the copy goes through pinned memory, so it does not wait for the device (the
    caching host allocator keeps the block until the copy is done); other devices (the meta device that counts a
    step) take a plain copy.
    """
    if device.type == "cpu":
        return torch.rand(count, generator=generator)
    return host_uniforms(generator, count, device).to(device, non_blocking=True)


def host_uniforms(generator: torch.Generator, count: int, device: torch.device) -> Tensor:
    """`mask_uniforms`' draw on the host, for a copy to `device` (into pinned memory for a GPU)."""
    host = torch.empty(count, pin_memory=device.type == "cuda")
    return torch.rand(count, generator=generator, out=host)


_drawers: ThreadPoolExecutor | None = None  # the threads that draw masks ahead (`MaskSampler.draw_ahead`)


def _draw_threads(count: int) -> ThreadPoolExecutor:
    """The process's pool of threads that draw masks ahead: `count` (its first caller's), at most one per CPU core
    the process may run on (more would only take turns: 3 draws at once on 2 cores took 23 ms each, 12 alone)."""
    global _drawers
    if _drawers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _drawers = ThreadPoolExecutor(max_workers=max(1, min(count, cores)), thread_name_prefix="slamb-masks")
    return _drawers


# ------------------------------------------------------------------------------------------ one chunk's mask
@dataclass(frozen=True)
class Run:
    """A mask's selection in one span: `rows[first:last]` of the mask, coordinates [a, b) of the compact vector's
    masked part."""

    span: Span
    first: int
    last: int
    a: int
    b: int


@dataclass(frozen=True)
class Mask:
    """S_t within one chunk: its always-synced coordinates and, for its masked slots, the selected rows.

    `rows` holds span-relative row indices, masked slot by masked slot in slot order; `runs` cuts it by span.
    Every length is fixed by the slots' sizes (and, for the cyclic mask, the phase), so the layout (`sizes`:
    coordinates per masked slot) is known on the host. `valid` (Bernoulli only) is 1 for a selected row and 0
    for padding, a duplicate of a selected one; None without padding.
    """

    rows: Tensor
    sizes: tuple[int, ...]
    runs: tuple[Run, ...]
    valid: Tensor | None

    def size(self, chunk: Chunk) -> int:
        """Length of this chunk's part of the compact vector: always-synced coordinates, then the masked ones."""
        return chunk.split - chunk.start + sum(self.sizes)

    def select(self, region: Tensor, out: Tensor) -> None:
        """out <- the selected rows of `region` (a chunk's flat span, padded), one call per span."""
        for run in self.runs:
            source, target = _words(run.span.of(region), out[run.a:run.b].view(-1, run.span.row_size))
            torch.index_select(source, 0, self.rows[run.first:run.last], out=target)

    def put(self, region: Tensor, values: Tensor) -> None:
        """The inverse of `select`: the selected rows of `region` <- `values`."""
        for run in self.runs:
            target, source = _words(run.span.of(region), values[run.a:run.b].view(-1, run.span.row_size))
            target.index_copy_(0, self.rows[run.first:run.last], source)

    def fill(self, scaled_freshness: Tensor, value: float) -> None:
        """The freshness of the selected rows <- `value`: one scalar per row."""
        for run in self.runs:
            run.span.freshness(scaled_freshness).index_fill_(0, self.rows[run.first:run.last], value)


def _words(*row_views: Tensor) -> tuple[Tensor, ...]:
    """Row views as rows of 8-byte words where all their layouts allow, else unchanged: the same bytes in fewer
    elements. Row copies cost per element on a CPU: fp32 rows of 16 as 8 words are copied 30 % faster. The words
    are float64 (copies move bits unchanged; on a CPU its index_copy_ is 15 % faster than int64's)."""
    def fits(rows: Tensor) -> bool:
        ratio = 8 // rows.element_size()
        return (ratio > 1 and rows.size(1) % ratio == 0 and rows.storage_offset() % ratio == 0
                and rows.stride(0) % ratio == 0)

    if all(fits(rows) for rows in row_views):
        return tuple(rows.view(torch.float64) for rows in row_views)
    return row_views


def _runs(spans: Sequence[Span], sizes: Sequence[int]) -> tuple[Run, ...]:
    """`Mask.runs` from a chunk's spans and per masked slot its selected coordinates."""
    runs: list[Run] = []
    row, coordinate = 0, 0
    for span in spans:
        size = sum(sizes[span.slots[0]:span.slots[1]])
        runs.append(Run(span, row, row + size // span.row_size, coordinate, coordinate + size))
        row, coordinate = row + size // span.row_size, coordinate + size
    return tuple(runs)


# ------------------------------------------------------------------------------------------ every chunk's masks
@dataclass(frozen=True)
class _Draw:
    """What turns a step's uniforms into the masks of consecutive chunks, built once (the stratified and Bernoulli
    masks): `uniforms` of them, turned into rows by `constants` (`stratified_rows` or `bernoulli_rows`), cut into
    `picks` rows per chunk; per chunk the host-side `sizes` and `runs` of its mask.
    """

    uniforms: int
    constants: dict[str, Any]
    picks: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    runs: tuple[tuple[Run, ...], ...]


class MaskSampler:
    """S_t chunk by chunk for one layout: a pure function of (seed, step), drawn from a private host generator.

    Stratified and Bernoulli: a few draws of uniforms (consecutive chunks of at most `draw_picks` rows each, None:
    one draw; each chunk's masked slots in slot order), turned into the rows of all masked slots by a few
    vectorised ops per draw, with constants built once. Cyclic: index lists built once, per chunk and phase.
    """

    def __init__(self, mask: str, k: float, chunks: Sequence[Chunk], device: torch.device,
                 draw_picks: int | None) -> None:
        self.mask, self.k, self.chunks, self.device = mask, k, chunks, device
        self.draws = _draws(mask, chunks, k, device, draw_picks)
        self.generator = torch.Generator()  # on the host whatever the device: see `mask_uniforms`
        self.cyclic: list[list[Mask]] | None = None  # per chunk, per phase
        # per (seed, step) the host uniforms of each draw, being drawn by `draw_ahead`
        self._ahead: dict[tuple[int, int], Future[list[Tensor]]] = {}

    def masks(self, seed: int, step: int) -> list[Mask]:
        """Every chunk's mask at `step`."""
        if self.mask == "cyclic":
            return self._cyclic_masks(seed, step)
        drawn = self._drawn_ahead(seed, step)
        if drawn is not None:
            per_draw = [uniforms.to(self.device, non_blocking=True) for uniforms in drawn]
        else:
            self.generator.manual_seed(mask_seed(seed, step))
            per_draw = [mask_uniforms(self.generator, draw.uniforms, self.device) for draw in self.draws]
        masks = []
        for draw, uniforms in zip(self.draws, per_draw, strict=True):
            if self.mask == "stratified":
                rows, valids = stratified_rows(uniforms, draw.constants), [None] * len(draw.picks)
            else:
                rows, valid = bernoulli_rows(uniforms, self.k, draw.constants)
                valids = valid.split(draw.picks)
            masks += [Mask(r, sizes, runs, v)
                      for r, sizes, runs, v in zip(rows.split(draw.picks), draw.sizes, draw.runs, valids, strict=True)]
        return masks

    def draw_ahead(self, seed: int, step: int, depth: int) -> None:
        """Start drawing the random numbers of the masks of the `depth` steps from `step`, those not yet under way,
        each on a thread of its own, for the `masks` calls that ask for them.

        The host's draw (about 2 million numbers at BERT-Large: 9 ms of one CPU core, 13 ms on an H100's host) then
        runs beside the host work that launches the rest of the step and the next forward and backward pass, not
        before it: torch's draw releases the GIL. A step's numbers come from one serial generator, so a draw cannot
        be split; the draws of several steps run at once instead, so that steps which follow each other faster
        than one draw (an optimizer timed alone) still find theirs drawn. Masks are pure functions of (seed, step),
        so a draw that goes unused (a loaded state, another step) changes nothing.
        """
        if self.mask == "cyclic":
            return
        for ahead in range(step, step + depth):
            if (seed, ahead) not in self._ahead:
                self._ahead[seed, ahead] = _draw_threads(depth).submit(self._host_draws, seed, ahead)

    def _drawn_ahead(self, seed: int, step: int) -> list[Tensor] | None:
        """The host uniforms of `step` if `draw_ahead` started them (waited for); drops the draws of earlier steps
        and of other seeds."""
        future = self._ahead.pop((seed, step), None)
        for key in [key for key in self._ahead if key[0] != seed or key[1] < step]:
            self._ahead.pop(key).cancel()  # one already running finishes on its own generator and is dropped
        return future.result() if future is not None else None

    def _host_draws(self, seed: int, step: int) -> list[Tensor]:
        """Each draw's uniforms at `step`, on the host (what `masks` would draw), from a generator of its own: the
        draws of several steps run at once."""
        generator = torch.Generator().manual_seed(mask_seed(seed, step))
        return [host_uniforms(generator, draw.uniforms, self.device) for draw in self.draws]

    def _cyclic_masks(self, seed: int, step: int) -> list[Mask]:
        """Phase t mod n_c of a fixed random partition of each masked tensor into n_c = floor(1/k) near-equal parts.

        Built once from the seed (each tensor's permutation of its rows from its own generator seed), per chunk
        and phase as one row list (8 bytes per row of up to 16 coordinates); only the seed goes into the state_dict.
        """
        parts = cyclic_parts(self.k)
        if self.cyclic is None:
            self.cyclic = [self._cyclic_phases(chunk, seed, parts) for chunk in self.chunks]
        return [phases[step % parts] for phases in self.cyclic]

    def _cyclic_phases(self, chunk: Chunk, seed: int, parts: int) -> list[Mask]:
        """One chunk's mask in each phase: its masked slots' parts, in slot order, as span-relative rows."""
        phases: list[list[Tensor]] = [[] for _ in range(parts)]
        for slot, base in zip(chunk.masked, chunk.bases, strict=True):
            generator = self.generator.manual_seed(mask_seed(seed, 0x80000000 + slot.index))
            perm = torch.randperm(slot.rows, generator=generator)
            for phase, part in enumerate(perm.tensor_split(parts)):
                phases[phase].append(part.sort().values + base)
        masks = []
        for rows in phases:
            sizes = [r.numel() * s.row_size for r, s in zip(rows, chunk.masked, strict=True)]
            flat = torch.cat(rows).to(self.device) if rows else torch.empty(0, dtype=torch.int64, device=self.device)
            masks.append(Mask(flat, tuple(sizes), _runs(chunk.spans, sizes), None))
        return masks

    def scratch_bytes(self) -> int:
        """Bytes of the tensors kept between steps: the cyclic index lists and the draws' constants."""
        tensors = [mask.rows for phases in self.cyclic or [] for mask in phases]
        tensors += [t for draw in self.draws for t in draw.constants.values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _draws(mask: str, chunks: Sequence[Chunk], k: float, device: torch.device, limit: int | None) -> list[_Draw]:
    """The constants of every chunk's stratified or Bernoulli mask (none for the cyclic mask: fixed lists), for
    consecutive chunks of at most `limit` picks per draw (a larger chunk: alone; None: one draw)."""
    if mask == "cyclic":
        return []
    groups: list[list[tuple[Chunk, int]]] = []  # per draw, its chunks with their picks
    total = 0
    for chunk in chunks:
        picks = sum(mask_size(mask, s, k) // s.row_size for s in chunk.masked)
        if groups and (limit is None or total + picks <= limit):
            groups[-1].append((chunk, picks))
            total += picks
        else:
            groups.append([(chunk, picks)])
            total = picks
    return [_draw(mask, group, k, device) for group in groups]


def _draw(mask: str, chunks: Sequence[tuple[Chunk, int]], k: float, device: torch.device) -> _Draw:
    """One draw for consecutive chunks (with their picks). Uniforms are drawn chunk by chunk, each chunk's
    masked slots in parameter order; rows come out in slot order, relative to their span."""
    tensors, sizes, runs, first = [], [], [], 0
    for chunk, _ in chunks:
        # uniforms in parameter order, whatever the placement by row size (Bernoulli's: all of one size)
        by_index = sorted(chunk.masked, key=lambda s: s.index)
        firsts = list(accumulate((_draw_size(mask, s, k) for s in by_index), initial=first))
        at = {s.index: a for s, a in zip(by_index, firsts, strict=False)}
        for s, base in zip(chunk.masked, chunk.bases, strict=True):
            if mask == "bernoulli":  # single coordinates
                tensors.append((s.numel, _draw_size(mask, s, k), base))
            else:
                tensors.append((s.rows, stratified_count(s.rows, k), at[s.index], base))
        first = firsts[-1]
        sizes.append(tuple(mask_size(mask, s, k) for s in chunk.masked))
        runs.append(_runs(chunk.spans, sizes[-1]))
    constants = bernoulli_plan(tensors, device) if mask == "bernoulli" else stratified_plan(tensors, device)
    return _Draw(first, constants, tuple(picks for _, picks in chunks), tuple(sizes), tuple(runs))


# ------------------------------------------------------------------------------------------ agreement across ranks
def mask_fingerprint(masks: Sequence[Mask]) -> tuple[int, int]:
    """(selected rows, an integer hash of their positions in order): equal on two ranks iff, but for a hash
    collision, they drew the same masks. Integer arithmetic only, so exact on any device; one host read."""
    positions = [mask.rows for mask in masks]
    if not positions:
        return 0, 0
    flat = torch.cat(positions)
    prime = (1 << 31) - 1  # every product below stays under 2^62, the sum under 2^63 for 2^31 rows
    index = torch.arange(flat.numel(), device=flat.device)
    terms = (flat % prime * 48271 % prime + index % prime * 16807 % prime) % prime
    return flat.numel(), int(terms.sum())


def check_masks_agree(comm: Comm, masks: Sequence[Mask]) -> None:
    """Raise on every rank if any rank drew a mask other than rank 0's (once per run: it reads the device; on the
    meta device, which holds no values, there is nothing to compare)."""
    if any(mask.rows.is_meta for mask in masks):
        return
    mine = mask_fingerprint(masks)
    if comm.any(mine != comm.broadcast_object(mine)):
        raise RuntimeError(
            f"SLAMB: the ranks drew different sync masks at their first step (rank {comm.rank}: {mine[0]} rows, "
            f"hash {mine[1]}); every rank must run the same model, parameter order, optim.seed and optimizer "
            "options, or the momentum all-reduce would average unrelated coordinates"
        )
