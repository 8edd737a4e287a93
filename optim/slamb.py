"""SLAMB (Xu et al., ICML 2023): LAMB whose only per-step traffic is a randomly masked average of the momentum."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor

from conf.checks import check_choice, check_non_negative, check_positive, check_range, require
from optim._math import (
    bernoulli_capacity,
    bernoulli_plan,
    bernoulli_rows,
    bias_corrections,
    check_adam_hyperparameters,
    check_flags,
    closure_loss,
    foreach_adam_moments_,
    mask_seed,
    stratified_count,
    stratified_plan,
    stratified_rows,
    trust_ratio,
)
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import Comm, average_tensors_
from optim.restart import load_with_current_hyperparameters, zero_step_counts

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_FRESHNESS_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
_MASKS = ("stratified", "bernoulli", "cyclic")
_RESCALES = ("sum_of_products", "product_of_interpolations")
_BIAS_CORRECTION_FORMS = ("scalar", "full", "none")
# Elements per chunk of the flat buffers, by device type (absent: a whole param group). On the CPU the passes
# of one chunk stay in cache (see optim._math's FOREACH_CHUNK_NUMEL); on a GPU it bounds the scratch buffer
# (a tensor larger than the limit forms a chunk of its own).
_CHUNK_NUMEL = {"cpu": 1 << 20, "cuda": 1 << 26}
# Elements per piece of the moments' and the update's passes, by device type (absent: a whole tensor). On the CPU
# a piece stays in cache between the passes that form and use it; on a GPU, pieces would only multiply the kernel
# launches (BERT-Large: about 10,000 more per step, the step's whole cost), so each tensor is one piece.
_PIECE_NUMEL = {"cpu": 1 << 18}
# Rows per draw of the stratified and Bernoulli masks, by device type (absent: one draw for all chunks). On the
# CPU a draw's passes stay in cache; on a GPU one draw takes the fewest launches.
_DRAW_PICKS = {"cpu": 1 << 16}
_ROW_NUMEL = 16  # coordinates per row of the stratified and cyclic masks
_ALIGN = _ROW_NUMEL  # masked tensors start at multiples of this many elements: any row size divides it
_STRUCT_CODES = {torch.float16: "e", torch.float32: "f"}  # the freshness dtypes' codes in the struct module
_GLOBAL = "slamb"  # key of the optimizer-wide entry of `self.state` (the others are parameters)
# Per-parameter state that lives in the flat buffers ("freshness": fp32 r, written before the scaled form).
_BUFFERED = ("exp_avg", "exp_avg_sq", "scaled_freshness", "freshness")


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's moments and freshness live in the flat buffers."""

    param: Tensor
    offset: int
    numel: int
    always: bool  # 1-D or smaller than min_compress_numel: synced every step
    index: int  # position among all slots: seeds the tensor's cyclic partition
    block: int  # the mask selects rows of this many consecutive coordinates (1: single coordinates)
    row: int  # where its freshness starts in the freshness buffer, which holds one value per row

    @property
    def rows(self) -> int:
        return self.numel // self.block

    def flat(self, buffer: Tensor, start: int = 0) -> Tensor:
        """This slot's 1-D slice of `buffer`, a flat buffer whose element 0 is flat position `start`."""
        return buffer[self.offset - start:self.offset - start + self.numel]


@dataclass(frozen=True)
class _Piece:
    """Elements [a, b) of one slot, the unit of the foreach passes: a whole tensor, or on a CPU a cache-sized part."""

    slot: _Slot
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
        return self.slot.row + self.a // self.slot.block, self.slot.row + self.b // self.slot.block


@dataclass(frozen=True)
class _Group:
    """Pieces that one set of foreach calls processes, with their views of the flat buffers (built once, so a step
    dispatches no per-tensor view); [start, end) is the flat span they cover, [first, last) their freshness rows."""

    pieces: tuple[_Piece, ...]
    start: int
    end: int
    first: int
    last: int
    views: dict[str, list[Tensor]]
    # Runs of pieces of one row size: (B, first element, end element, first row, end row) relative to the group
    # (an update group of a GPU layout only: see `_Layout._update_group`).
    segments: tuple[tuple[int, int, int, int, int], ...] = ()


@dataclass(frozen=True)
class _Span:
    """A chunk's masked slots of one row size. A chunk places its masked slots by row size, so they are consecutive
    in the flat buffers; the freshness buffer holds their rows in the same order and spacing, so a row index
    relative to the span addresses a row of coordinates and its freshness alike."""

    block: int
    start: int  # chunk-relative elements [start, end)
    end: int
    row: int  # the freshness buffer's row of `start`
    slots: tuple[int, int]  # its masked slots' [first, last) indices in the chunk's `masked`

    def of(self, region: Tensor) -> Tensor:
        """The span's rows of a chunk's region of a flat buffer."""
        return region[self.start:self.end].view(-1, self.block)

    def freshness(self, scaled_freshness: Tensor) -> Tensor:
        """The span's rows of the freshness buffer."""
        return scaled_freshness[self.row:self.row + (self.end - self.start) // self.block]


@dataclass(frozen=True)
class _Chunk:
    """Consecutive slots of one param group: always-synced ones in [start, split), masked ones in [split, end).

    Masked slots (and chunks) start at multiples of `_ALIGN` elements, and are placed by row size, so that one row
    view of a buffer over a span serves every masked slot with that row size; the padding (zeros, at most
    `_ALIGN` - 1 elements per masked tensor) is never gathered, sent or normed.
    """

    group: int
    start: int
    split: int
    end: int
    slots: tuple[_Slot, ...]
    masked: tuple[_Slot, ...]  # the slots in [split, end)
    one_d: Tensor  # per slot, dim <= 1 (on the device, built once: the clamp_1d switch needs no host copy)
    spans: tuple[_Span, ...]  # the masked slots by row size
    bases: tuple[int, ...]  # per masked slot, the span-relative index of its first row
    rows: tuple[int, int, int]  # freshness rows: the always-synced slots' in [first, split), masked in [split, end)
    directions: list[Tensor]  # per slot, its view of the direction space (the work buffer), shaped like it
    moments: tuple[_Group, ...]  # every slot, by cache-sized groups on a CPU: the passes over m, v, g, direction
    updates: tuple[_Group, ...]  # the masked slots, likewise: the coefficient and update passes

    @property
    def padded(self) -> int:
        """Elements of the chunk's span rounded up to `_ALIGN`: its row views' length."""
        return _aligned(self.end - self.start)


@dataclass(frozen=True)
class _Mask:
    """S_t within one chunk: its always-synced coordinates and, for its masked slots, the selected rows.

    `rows` holds span-relative row indices, masked slot by masked slot in slot order; `runs` cuts it by span.
    Every length is fixed by the slots' sizes (and, for the cyclic mask, the phase), so the layout (`sizes`:
    coordinates per masked slot) is known on the host. `valid` (Bernoulli only) is 1 for a selected row and 0
    for padding, a duplicate of a selected one; None without padding.
    """

    rows: Tensor
    sizes: tuple[int, ...]
    runs: tuple[_Run, ...]
    valid: Tensor | None

    def size(self, chunk: _Chunk) -> int:
        """Length of this chunk's part of the compact vector: always-synced coordinates, then the masked ones."""
        return chunk.split - chunk.start + sum(self.sizes)

    def select(self, region: Tensor, out: Tensor) -> None:
        """out <- the selected rows of `region` (a chunk's flat span, padded), one call per span."""
        for run in self.runs:
            source, target = _words(run.span.of(region), out[run.a:run.b].view(-1, run.span.block))
            torch.index_select(source, 0, self.rows[run.first:run.last], out=target)

    def put(self, region: Tensor, values: Tensor) -> None:
        """The inverse of `select`: the selected rows of `region` <- `values`."""
        for run in self.runs:
            target, source = _words(run.span.of(region), values[run.a:run.b].view(-1, run.span.block))
            target.index_copy_(0, self.rows[run.first:run.last], source)

    def fill(self, scaled_freshness: Tensor, value: float) -> None:
        """The freshness of the selected rows <- `value`: one scalar per row."""
        for run in self.runs:
            run.span.freshness(scaled_freshness).index_fill_(0, self.rows[run.first:run.last], value)


@dataclass(frozen=True)
class _Run:
    """A mask's selection in one span: `rows[first:last]` of the mask, coordinates [a, b) of the compact vector's
    masked part."""

    span: _Span
    first: int
    last: int
    a: int
    b: int


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


def _runs(spans: Sequence[_Span], sizes: Sequence[int]) -> tuple[_Run, ...]:
    """`_Mask.runs` from a chunk's spans and per masked slot its selected coordinates."""
    runs: list[_Run] = []
    row, coordinate = 0, 0
    for span in spans:
        size = sum(sizes[span.slots[0]:span.slots[1]])
        runs.append(_Run(span, row, row + size // span.block, coordinate, coordinate + size))
        row, coordinate = row + size // span.block, coordinate + size
    return tuple(runs)


@dataclass(frozen=True)
class _Draw:
    """What turns a step's uniforms into the masks of a run of consecutive chunks, built once (the stratified and
    Bernoulli masks): `uniforms` of them, turned into rows by `constants` (`stratified_rows` or `bernoulli_rows`),
    cut into `picks` rows per chunk; per chunk the host-side `sizes` and `runs` of its mask.
    """

    uniforms: int
    constants: dict[str, Any]
    picks: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]
    runs: tuple[tuple[_Run, ...], ...]


class SLAMB(torch.optim.Optimizer):
    r"""Sparse-communication LAMB (Xu, Zhang, Fei, Wu, Xie, Huang, Xie, Elhoseiny, Kalnis; ICML 2023).

    Data-parallel LAMB without a gradient all-reduce (register it with ``grad_sync="self"``: the trainer runs
    no DDP). Rank :math:`i` at step :math:`t`, with its local gradient :math:`g_i` (after AMP unscale and the
    trainer's local clipping), :math:`N` ranks, per parameter tensor :math:`w`:

    .. math::
        m_i &\leftarrow \beta_1 m_i + (1-\beta_1) g_i, \qquad v_i \leftarrow \beta_2 v_i + (1-\beta_2) g_i^2
            \quad \text{(local; } v \text{ is never communicated)} \\
        m_i[S_t] &\leftarrow \tfrac1N \textstyle\sum_j m_j[S_t]
            \quad \text{(one all-reduce of the compacted coordinates } S_t \text{)} \\
        r &\leftarrow \beta_3 r, \quad r[S_t] \leftarrow 1
            \quad \text{(freshness } r = \beta_3^{\text{staleness}} \text{, 1 before step 1)} \\
        \tilde u &= \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} \frac{m_i}{\sqrt{v_i} + \epsilon} + \lambda w \\
        \phi_F &= \mathrm{clamp}(\lVert w_F\rVert / \lVert \tilde u_F\rVert, c_{min}, c_{max}), \quad
        \phi_U = \mathrm{clamp}(\lVert w_U\rVert / \lVert \tilde u_U\rVert, 0, c_{max}) \\
        w &\leftarrow w - \big[\eta\,\phi_F\, r + \tfrac{\eta}{\sqrt N}\,\phi_U\,(1-r)\big] \odot \tilde u

    with :math:`F = S_t \cap w` (fresh) and :math:`U = w \setminus S_t` (stale); :math:`\phi_F` falls back to 1
    and :math:`\phi_U` to 0 when a norm is 0. Every ``sync_interval`` steps (after steps 1, 1+H, ...) the
    parameters are averaged densely; m, v and r are not. These are the semantics of the official
    ``Slamb_V2`` (hangxu0304/SLAMB @ 7388495, ``Swin-Transformer/optimizer.py``), except that by default the
    trust-ratio norms include the decay term as in LAMB (``wd_in_trust_ratio=True``; V2 is False) and the masks
    come from a private generator (below); the naive ``Slamb`` class is ``mask="cyclic",
    rescale="product_of_interpolations", bias_correction_form="full", stale_ratio_fallback=1, clamp_1d=False``.

    :math:`S_t` holds every coordinate of a tensor with ``dim <= 1`` or ``numel < min_compress_numel`` and,
    elsewhere, coordinates drawn from a private generator seeded by ``(seed, t)``, so all ranks agree without
    sending indices and the global RNG is never touched (the official code reseeds it every step).
    ``stratified`` (the default): each masked tensor of :math:`n` elements is cut into rows of :math:`B` = up
    to 16 consecutive coordinates (a 64-byte cache line; the largest power of two dividing :math:`n`) and
    exactly :math:`c = \mathrm{round}(k n / B)` rows are selected, one uniformly in each of :math:`c`
    near-equal strata at a random rotation. Every coordinate is synced with probability exactly
    :math:`cB/n \approx k`, independently across steps, as under Bernoulli draws; coordinates of one row go
    together. The fixed count sizes the all-reduce without asking the device, and rows make the draw, the
    gathers and the scatters 16 times cheaper than single coordinates. ``bernoulli`` (Slamb_V2): each
    coordinate independently with probability :math:`k`, a random count, drawn as geometric gaps (about
    :math:`k n` random numbers) into a fixed capacity of mean :math:`+ 8\sigma + 16` positions, padded with a
    duplicate of a selected one; the padding is sent too (counted in the bytes), and past the capacity
    (probability below 1e-15 per tensor and step) the last selections wait for a later step. ``cyclic``
    (Slamb): a fixed random partition of each tensor into :math:`n_c = \lfloor 1/k\rfloor` parts, part
    :math:`t \bmod n_c` at step :math:`t`, as index lists built once (4 bytes per masked coordinate). With
    every mask a step reads nothing back from the device (no ``.item()``, ``nonzero`` or data-dependent
    shape), so on a GPU it never waits for the device.

    Averaging the momentum, not the gradient, loses nothing at a synced coordinate: the EMA is linear, so the
    rank mean of the local momenta there equals the momentum of the mean gradient, however stale the
    coordinate was (local error compensation without a residual buffer).

    Args (defaults and their source; [code] = the official repository, [fork] = the authors' DeepSpeed BERT):
        params: parameters or param groups; lr, betas, eps and weight_decay are honoured per group.
        lr: :math:`\eta`, set each step by the trainer's schedule.
        betas: :math:`(\beta_1, \beta_2)` = (0.9, 0.999) [code].
        eps: :math:`\epsilon` = 1e-6, the class default of [code] and [fork] (Swin config: 1e-8).
        weight_decay: :math:`\lambda` = 0.01 [fork]; LAMB-style L2 added to the direction.
        compress_ratio: :math:`k`, the synced fraction of the masked coordinates, 0.1 [code].
        beta3: freshness decay; 0.99 is the class default of [code] and [fork] (Swin config 0.999; the
            project requirements quote 0.93 for the paper, unverified, see the BERT experiments).
        sync_interval: :math:`H`, steps between dense parameter averages, 100 [code].
        min_compress_numel: :math:`\tau`, tensors with fewer elements (or 1-D) are synced every step, 9000 [code].
        trust_ratio_bounds: :math:`(c_{min}, c_{max})` = (0.01, 1000) [code], the clamp of the trust ratios
            (not LAMB's boolean ``trust_clip``).
        mask: ``"stratified"`` (fixed count, the default), ``"bernoulli"`` (Slamb_V2) or ``"cyclic"`` (Slamb).
        rescale: ``"sum_of_products"`` (V2, above) or ``"product_of_interpolations"`` (naive):
            :math:`w \leftarrow w - \mathrm{clamp}(r\phi_F + (1-r)\phi_U, c_{min}, c_{max})
            \,(r\eta + (1-r)\eta/\sqrt N)\,\tilde u`.
        bias_correction_form: ``"scalar"`` (V2: :math:`\epsilon` added to :math:`\sqrt v`, as above), ``"full"``
            (naive and LAMB: :math:`\hat m / (\sqrt{\hat v} + \epsilon)`) or ``"none"`` (where LAMB has a
            boolean ``bias_correction``).
        wd_in_trust_ratio: the trust-ratio norms include :math:`\lambda w` (LAMB and the naive class); False
            is V2, which adds it only when applying the update.
        stale_ratio_fallback: :math:`\phi_U` when a stale norm is 0: 0 (V2) or 1 (naive).
        clamp_1d: clamp the ratios of 1-D tensors too (V2); False leaves them unclamped (naive).
        comm_dtype: payload of the momentum all-reduce: ``"fp32"`` [code], ``"fp16"`` [fork] or ``"bf16"``.
            In half precision each rank divides its share by :math:`N` before the cast (so the sum stays in
            range), the backend sums half-precision values (partial sums rounded to the wire dtype, not fp32),
            and the mean is cast back into the fp32 momentum; the bytes counted are the half-precision
            payload's, 2 per synced coordinate.
        freshness_dtype: storage of the freshness, ``"fp16"`` (2 bytes per row of the mask; r within a relative
            :math:`2^{-11}` of :math:`\beta_3^j`, plus one such rounding per rescaling below, with no error
            carried from step to step) or ``"fp32"`` (4 bytes per row; the parity preset, within 1e-5 of the official
            transcriptions). Either way the state holds :math:`q = r / \beta_3^{t \bmod R}` and multiplies q by
            :math:`\beta_3^R` once every R steps (R: the largest with :math:`\beta_3^{-(R-1)} \le 2^{15}`, 1035
            for 0.99, 10393 for 0.999) instead of multiplying r by :math:`\beta_3` every step: a synced coordinate
            gets :math:`q = \beta_3^{-(t \bmod R)}`, and :math:`\beta_3^{t \bmod R}` is folded into the per-tensor
            coefficients of the update.
        sync_offset: dense sync when :math:`(t - \text{sync\_offset}) \bmod H = 0`; 1 as in [code].
        bucket_mb: the compacted momentum and the dense parameter average go out in all-reduces of at most
            this many MB (one per bucket, never one per tensor).
        seed: seeds the masks; ranks must agree (the trainer passes the same config to every rank).
        comm: the communication layer (`optim.comm.Comm`); None builds one over the default process group,
            or a world of one when there is none.

    State: per parameter ``exp_avg``, ``exp_avg_sq`` (fp32, shaped like it) and ``scaled_freshness`` (q, in
    ``freshness_dtype``, one value per row of the mask: a synced row is synced whole, so its coordinates share
    their freshness; 1-D, of numel / row size), views of flat buffers, and under the key ``"slamb"`` the step and
    the mask seed, all in `state_dict()`; masks are pure functions of (seed, step) and R of beta3, so nothing else
    is needed to resume exactly (`freshness` gives r per coordinate; a state_dict of earlier versions, with the
    fp32 ``freshness`` or a per-coordinate ``scaled_freshness``, is converted on load). Moments and,
    between dense syncs, parameters differ across ranks, so checkpoints are per rank (the trainer does this for
    ``grad_sync="self"``). Work buffers, kept between steps (`memory_bytes`): one buffer that holds the compact
    vector (about :math:`k d`) and then, chunk by chunk, the chunk's direction with its gathered fresh direction
    and weights; and the per-row coefficient buffers of one update group.

    Mechanics: the flat buffers are cut into chunks (a GPU: 2^26 elements, a CPU: 2^20, cache-sized). Each masked
    tensor starts at a multiple of 16 elements (at most 15 zero elements of padding per tensor, never gathered,
    sent or normed) and a chunk places its masked tensors by row size, so one row view of a buffer over a span
    serves all its masked tensors of one row size: a step's mask (one vectorised draw per run of chunks from
    per-tensor constants built once), the momentum gather and scatter, the freshness fill and the fresh norms
    (`torch._foreach_norm` over one split) cost a fixed number of calls per chunk, not per tensor, and the
    update runs as foreach calls with per-tensor 0-d coefficients, formed per row and broadcast over it. A
    GPU step thus dispatches a number of ops independent of the number of tensors (each dispatch costs host
    time); on a CPU the passes go by pieces of at most 2^18 elements, which keep their operands in cache.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        compress_ratio: float = 0.1,
        beta3: float = 0.99,
        sync_interval: int = 100,
        min_compress_numel: int = 9000,
        trust_ratio_bounds: Sequence[float] = (0.01, 1000.0),
        mask: str = "stratified",
        rescale: str = "sum_of_products",
        bias_correction_form: str = "scalar",
        wd_in_trust_ratio: bool = True,
        stale_ratio_fallback: float = 0.0,
        clamp_1d: bool = True,
        comm_dtype: str = "fp32",
        freshness_dtype: str = "fp16",
        sync_offset: int = 1,
        bucket_mb: float = 64.0,
        seed: int = 0,
        comm: Comm | None = None,
    ) -> None:
        run_check("SLAMB", check_slamb_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compress_ratio=compress_ratio, beta3=beta3,
            sync_interval=sync_interval, min_compress_numel=min_compress_numel,
            trust_ratio_bounds=trust_ratio_bounds, mask=mask, rescale=rescale,
            bias_correction_form=bias_correction_form, wd_in_trust_ratio=wd_in_trust_ratio,
            stale_ratio_fallback=stale_ratio_fallback, clamp_1d=clamp_1d, comm_dtype=comm_dtype,
            freshness_dtype=freshness_dtype, sync_offset=sync_offset, bucket_mb=bucket_mb, seed=seed,
        ))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.compress_ratio = float(compress_ratio)
        self.beta3 = float(beta3)
        self.sync_interval = int(sync_interval)
        self.min_compress_numel = int(min_compress_numel)
        self.trust_ratio_bounds = (float(trust_ratio_bounds[0]), float(trust_ratio_bounds[1]))
        self.mask, self.rescale, self.bias_correction_form = mask, rescale, bias_correction_form
        self.wd_in_trust_ratio, self.clamp_1d = bool(wd_in_trust_ratio), bool(clamp_1d)
        self.stale_ratio_fallback = float(stale_ratio_fallback)
        self.comm_dtype = _COMM_DTYPES[comm_dtype]
        self.freshness_dtype = _FRESHNESS_DTYPES[freshness_dtype]
        self.sync_offset = int(sync_offset)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.comm = comm if comm is not None else Comm()
        self.world_size = self.comm.world_size  # read once, from the group (the official V2 starts at 1)
        self.state[_GLOBAL] = {"step": 0, "seed": int(seed)}
        self._layout: _Layout | None = None
        self._masks_agreed = False  # checked once per process, at its first multi-rank step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load m, v and the freshness straight into the flat buffers, one tensor at a time.

        Torch's loader would first copy every state tensor to the parameters' device (and the fp16 freshness
        to fp32) while the buffers are alive: twice the state at once, which a 2.9B-parameter model cannot
        afford. Here only the small entries go through it; the buffers are built once (if not yet) and filled
        in place from the given tensors, wherever they are.
        """
        if _GLOBAL not in state_dict["state"]:
            raise ValueError("SLAMB.load_state_dict: no 'slamb' entry (step, seed); not a SLAMB state_dict")
        layout = self._ensure_layout()
        saved = state_dict["state"]
        small = {key: {k: v for k, v in entry.items() if k not in _BUFFERED} for key, entry in saved.items()}
        super().load_state_dict({**state_dict, "state": small})
        indices = [i for group in state_dict["param_groups"] for i in group["params"]]
        for index, slot in zip(indices, layout.slots_in_group_order, strict=True):
            entry = self.state[slot.param]
            entry.update({k: v for k, v in saved.get(index, {}).items() if k in _BUFFERED})
        layout.adopt(self.state, self.beta3, self.state[_GLOBAL]["step"])

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step: local moments, masked momentum average, rescaled LAMB update, periodic dense sync.

        Nothing in it reads a tensor on the host: sizes come from the layout and the mask kind, per-tensor ratios
        stay 0-d device tensors, and choices between values are `torch.where`.
        """
        loss = closure_loss(closure)
        layout = self._ensure_layout()
        glob = self.state[_GLOBAL]
        glob["step"] += 1
        step = glob["step"]

        masks = self._masks(layout, step)
        spans = _spans(layout.chunks, masks)
        distributed = self.comm.distributed
        if distributed and not self._masks_agreed:
            _check_masks_agree(self.comm, masks)
            self._masks_agreed = True
        for chunk, mask, (a, b) in zip(layout.chunks, masks, spans, strict=True):
            self._local_moments(layout, chunk)
            if distributed:
                _gather(layout, chunk, mask, layout.compact[a:b])
        if distributed and spans:
            self._all_reduce_mean(layout.compact[:spans[-1][1]])
            for chunk, mask, (a, b) in zip(layout.chunks, masks, spans, strict=True):
                _scatter(layout, chunk, mask, layout.compact[a:b])
        for chunk, mask in zip(layout.chunks, masks, strict=True):  # the compact vector is free: work space
            self._update_chunk(layout, chunk, mask, step)
        if distributed and (step - self.sync_offset) % self.sync_interval == 0:
            # the dense fp32 average of every parameter, in tensor-aligned buckets of at most bucket_mb
            average_tensors_([slot.param for slot in layout.slots], self.comm, max(1, self.bucket_bytes // 4))
        return loss

    def _local_moments(self, layout: _Layout, chunk: _Chunk) -> None:
        """m and v of the chunk's slots that have a gradient, one foreach group at a time: on a CPU groups of at
        most `piece_numel` elements, whose three passes find m, v and g in cache (15 % faster than whole tensors)."""
        for s in chunk.slots:
            if s.param.grad is not None and s.param.grad.is_sparse:
                raise RuntimeError("SLAMB does not support sparse gradients")
        beta1, beta2 = self.param_groups[chunk.group]["betas"]
        flat_grads: dict[int, Tensor] = {}  # a split slot's fp32 gradient, flattened once
        for group in chunk.moments:
            active = [i for i, piece in enumerate(group.pieces) if piece.slot.param.grad is not None]
            if active:
                grads = [_grad_piece(group.pieces[i], flat_grads) for i in active]
                foreach_adam_moments_([group.views["m"][i] for i in active], [group.views["v"][i] for i in active],
                                      grads, beta1, beta2)

    def _all_reduce_mean(self, compact: Tensor) -> None:
        """m[S_t] <- the rank mean, in buckets of at most bucket_mb (see `comm_dtype` for the half-precision path)."""
        if self.comm_dtype == torch.float32:
            payload = compact
        else:  # divide first, so that the half-precision sum stays in range; cast for the wire
            payload = compact.mul_(1.0 / self.world_size).to(self.comm_dtype)
        bucket = max(1, self.bucket_bytes // payload.element_size())
        works = [self.comm.all_reduce(piece, async_op=True) for piece in payload.split(bucket)]
        for work in works:
            work.wait()
        if payload is compact:
            compact.div_(self.world_size)
        else:
            compact.copy_(payload)

    def _update_chunk(self, layout: _Layout, chunk: _Chunk, mask: _Mask, step: int) -> None:
        """Freshness, Adam direction, fresh/stale trust ratios and the rescaled update of one chunk."""
        start, scaled, (first, split, end) = chunk.start, layout.scaled_freshness, chunk.rows
        if step % layout.rebase_interval == 0:  # a new epoch E = t: q <- q beta3^R keeps r = beta3^(t - E) q
            scaled[split:end].mul_(self.beta3 ** layout.rebase_interval)
        synced = layout.synced_value(self.beta3, step)  # q at a coordinate synced now (r = 1)
        scaled[first:split].fill_(synced)
        mask.fill(scaled, synced)
        to_freshness = 1.0 / synced  # r = q / synced (1 to fp32 rounding where synced now), in the coefficients

        group = self.param_groups[chunk.group]
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        bc1, bc2 = bias_corrections(step, beta1, beta2, enabled=self.bias_correction_form != "none")
        # The direction buffer holds u~ up to a scalar `unit` (u~ = unit * buffer), folded into the norms and the
        # step sizes instead of costing a pass: buffer = m / (sqrt(v) + eps') + (lambda / scale) w with
        # unit = scale, the decay added before the norms or after them (wd_in_trust_ratio). Every slot's direction
        # is formed (the ratios are computed for the whole chunk at once); only slots with a gradient are updated.
        scale = unit = math.sqrt(bc2) / bc1
        eps = group["eps"] * (math.sqrt(bc2) if self.bias_correction_form == "full" else 1.0)
        layout.gather_weights(chunk, mask)  # before the direction takes the work space
        params = [s.param for s in chunk.slots]
        decay_in_norms = weight_decay != 0 and self.wd_in_trust_ratio
        # On a CPU, where a step is not bound by the host: buffer = w + m / ((lambda / scale)(sqrt(v) + eps'))
        # with unit = lambda, one addcdiv pass per piece where the foreach form takes a division and an addition
        # (a pass more, about 8 % of the BERT-base step); group by group, so that sqrt(v) is still in cache.
        fused = decay_in_norms and layout.piece_numel is not None
        for group in chunk.moments:
            direction = layout.work[group.start - start:group.end - start]
            torch.sqrt(layout.exp_avg_sq[group.start:group.end], out=direction)
            direction.add_(eps)
            if fused:
                for piece, m, u in zip(group.pieces, group.views["m"], group.views["direction"], strict=True):
                    torch.addcdiv(piece.of(piece.slot.param), m, u, value=scale / weight_decay, out=u)
            else:
                torch.div(layout.exp_avg[group.start:group.end], direction, out=direction)
        if fused:
            unit = weight_decay
        elif decay_in_norms:
            torch._foreach_add_(chunk.directions, params, alpha=weight_decay / scale)
        fresh, stale = self._trust_ratios(layout, chunk, mask, unit)
        if weight_decay != 0 and not self.wd_in_trust_ratio:
            torch._foreach_add_(chunk.directions, params, alpha=weight_decay / scale)

        lr_fresh, lr_stale = lr * unit, lr * unit / math.sqrt(self.world_size)
        fresh_clamped, stale_clamped = self._clamp_ratios(chunk, fresh, stale)
        fresh_coef = fresh_clamped * -lr_fresh  # per slot, on the device: no host read
        always = [i for i, s in enumerate(chunk.slots) if s.always and s.param.grad is not None]
        if always:  # r == 1 on every coordinate: plain LAMB steps with the fresh ratio
            coefs = fresh_coef.unbind()
            torch._foreach_addcmul_([params[i] for i in always], [chunk.directions[i] for i in always],
                                    [coefs[i] for i in always])
        if not chunk.masked:
            return
        if self.rescale == "sum_of_products":  # coef = -[lr_stale phi_U + r (lr_fresh phi_F - lr_stale phi_U)]
            stale_coef = stale_clamped * -lr_stale
            bases, slopes = stale_coef.unbind(), ((fresh_coef - stale_coef) * to_freshness).unbind()
        else:  # naive: coef = -clamp(phi_U + r (phi_F - phi_U)) (lr_stale + r (lr_fresh - lr_stale))
            bases, slopes = stale.unbind(), ((fresh - stale) * to_freshness).unbind()
        for pieces in chunk.updates:
            self._apply(layout, pieces, bases, slopes, (lr_stale - lr_fresh) * to_freshness, lr_stale)

    def _apply(self, layout: _Layout, group: _Group, bases: Sequence[Tensor], slopes: Sequence[Tensor],
               lr_slope: float, lr_stale: float) -> None:
        """w -= coef * u over one group of masked pieces, coef per row from the rescale form, through a buffer.

        The freshness, hence the coefficient, is constant over a row of the mask, so the coefficients of the whole
        group are formed per row at once (a sixteenth of the work per coordinate): a copy of the scaled freshness
        q, a foreach multiply and add with the per-tensor 0-d slopes and bases (a loop in C++, not in Python), and
        for the product form three passes more. The update broadcasts each row's coefficient over the row.
        `slopes` and `lr_slope` are per unit of q.
        """
        active = [i for i, piece in enumerate(group.pieces) if piece.slot.param.grad is not None]
        if not active:
            return
        scaled = layout.scaled_freshness[group.first:group.last]
        coef = layout.coef[:group.last - group.first]
        coef.copy_(scaled)  # to fp32 first: a product with a 0-d fp32 tensor would be computed in fp16
        coefs = [group.views["coef"][i] for i in active]
        # twice as fast as one addcmul with 0-d operands on a CPU
        torch._foreach_mul_(coefs, [slopes[group.pieces[i].at] for i in active])
        torch._foreach_add_(coefs, [bases[group.pieces[i].at] for i in active])
        if self.rescale == "product_of_interpolations":  # interpolate the raw ratios, clamp, times the mixed lr
            coef.clamp_(*self.trust_ratio_bounds)  # a masked tensor is never 1-D: clamp_1d does not apply
            # ratio (-lr_stale - r (lr_fresh - lr_stale)), in two passes through the second buffer
            spare = layout.spare[:coef.numel()]
            torch.mul(coef, -lr_stale, out=spare)
            torch.addcmul(spare, coef, scaled, value=lr_slope, out=coef)
        pieces = [group.pieces[i] for i in active]
        weights = [piece.of(piece.slot.param) for piece in pieces]
        directions = [group.views["direction"][i] for i in active]
        if group.segments:  # a GPU layout: spread the coefficients, then one fused update
            for block, a, b, row_a, row_b in group.segments:
                layout.spread[a:b].view(-1, block).copy_(coef[row_a:row_b, None].expand(-1, block))
            torch._foreach_addcmul_(weights, directions, [group.views["spread"][i] for i in active])
        elif all(w.is_contiguous() for w in weights):
            torch._foreach_addcmul_([w.view(-1, piece.slot.block) for w, piece in zip(weights, pieces, strict=True)],
                                    directions, coefs)
        else:  # a strided parameter (channels_last) has no row view: scale the direction's rows, then add
            torch._foreach_mul_(directions, coefs)
            torch._foreach_add_(weights, [u.view_as(w) for u, w in zip(directions, weights, strict=True)])

    def _trust_ratios(self, layout: _Layout, chunk: _Chunk, mask: _Mask, unit: float) -> tuple[Tensor, Tensor]:
        """Per slot the raw (unclamped) phi_F and phi_U over the fresh coordinates S_t and the stale rest, with
        their fallbacks for zero norms.

        Fresh norms come from the few selected coordinates, gathered into compact buffers (the weights by
        `_Layout.gather_weights`); stale ones by difference from the whole-tensor norms, so no pass touches the
        stale 90 % twice.
        """
        params = [s.param for s in chunk.slots]
        w_total = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
        u_total = torch.stack(torch._foreach_norm(chunk.directions))
        w_fresh, u_fresh = w_total, u_total
        if chunk.masked:
            u_selected, w_selected = layout.selected(chunk, mask)
            mask.select(layout.work[:chunk.padded], u_selected)
            if mask.valid is not None:  # padding duplicates a selected coordinate: count it once
                u_selected.mul_(mask.valid)
                w_selected.mul_(mask.valid)
            w_parts, u_parts = w_selected.split(mask.sizes), u_selected.split(mask.sizes)
            always = len(chunk.slots) - len(chunk.masked)
            w_fresh = torch.cat([w_total[:always], torch.stack(torch._foreach_norm(w_parts))])
            u_fresh = torch.cat([u_total[:always], torch.stack(torch._foreach_norm(u_parts))])
        u_total, u_fresh = u_total * unit, u_fresh * unit
        w_stale = (w_total.square() - w_fresh.square()).clamp_(min=0).sqrt_()
        u_stale = (u_total.square() - u_fresh.square()).clamp_(min=0).sqrt_()
        fresh = trust_ratio(w_fresh, u_fresh)  # 1 when a norm is 0
        stale = torch.where((w_stale > 0) & (u_stale > 0), w_stale / u_stale,
                            torch.full_like(w_stale, self.stale_ratio_fallback))
        return fresh, stale

    def _clamp_ratios(self, chunk: _Chunk, fresh: Tensor, stale: Tensor) -> tuple[Tensor, Tensor]:
        """phi_F clamped to [c_min, c_max] and phi_U to [0, c_max] (1-D tensors left alone without clamp_1d)."""
        c_min, c_max = self.trust_ratio_bounds
        fresh_clamped, stale_clamped = fresh.clamp(c_min, c_max), stale.clamp(0.0, c_max)
        if not self.clamp_1d:
            fresh_clamped = torch.where(chunk.one_d, fresh, fresh_clamped)
            stale_clamped = torch.where(chunk.one_d, stale, stale_clamped)
        return fresh_clamped, stale_clamped

    # ------------------------------------------------------------------------------------------ masks
    def _masks(self, layout: _Layout, step: int) -> list[_Mask]:
        """S_t chunk by chunk: a pure function of (seed, step), drawn from the layout's private generator.

        A few draws of uniforms (runs of chunks; each chunk's masked slots in slot order) and a few vectorised ops
        per draw turn them into the rows of all masked slots, with constants built once (`_Layout.draws`).
        """
        if self.mask == "cyclic":
            return layout.cyclic_masks(self.state[_GLOBAL]["seed"], self.compress_ratio, step)
        generator = layout.generator
        generator.manual_seed(mask_seed(self.state[_GLOBAL]["seed"], step))
        masks = []
        for draw in layout.draws:
            uniforms = mask_uniforms(generator, draw.uniforms, layout.exp_avg.device)
            if self.mask == "stratified":
                rows, valids = stratified_rows(uniforms, draw.constants), [None] * len(draw.picks)
            else:
                rows, valid = bernoulli_rows(uniforms, self.compress_ratio, draw.constants)
                valids = valid.split(draw.picks)
            masks += [_Mask(r, sizes, runs, v)
                      for r, sizes, runs, v in zip(rows.split(draw.picks), draw.sizes, draw.runs, valids, strict=True)]
        return masks

    def sync_masks(self, step: int) -> list[Tensor]:
        """The boolean mask S_`step` of every parameter (param_groups order): which coordinates that step averages.

        A pure function of the seed and the step (the same on every rank); for tests and analysis.
        """
        layout = self._ensure_layout()
        flat = torch.zeros(layout.numel, dtype=torch.bool, device=layout.exp_avg.device)
        for chunk, mask in zip(layout.chunks, self._masks(layout, step), strict=True):
            flat[chunk.start:chunk.split] = True
            region = flat[chunk.start:chunk.start + chunk.padded]
            for run in mask.runs:
                rows = mask.rows[run.first:run.last]
                valid = rows if mask.valid is None else rows[mask.valid[run.first:run.last].bool()]
                run.span.of(region)[valid] = True
        return [flat[s.offset:s.offset + s.numel].view_as(s.param) for s in layout.slots_in_group_order]

    def freshness(self) -> list[Tensor]:
        """The freshness r = beta3^staleness of every parameter (param_groups order), in fp32: for tests, analysis."""
        layout = self._ensure_layout()
        to_freshness = 1.0 / layout.synced_value(self.beta3, self.state[_GLOBAL]["step"])
        return [(self.state[s.param]["scaled_freshness"].float() * to_freshness).repeat_interleave(s.block)
                .view_as(s.param) for s in layout.slots_in_group_order]

    def restart_freshness(self) -> None:
        """Store each row's freshness r as at step 0 (q = r there), before a run continues this state with a fresh
        step count: q / beta3^-(t mod R) in one pass (rounded once, as `freshness` rounds it)."""
        layout = self._ensure_layout()
        layout.scaled_freshness.mul_(1.0 / layout.synced_value(self.beta3, self.state[_GLOBAL]["step"]))

    def restart(self, saved: dict[str, Any]) -> None:
        """Continue another run's state with fresh step counts (`optim.restart`), each row's freshness kept."""
        load_with_current_hyperparameters(self, saved)
        self.restart_freshness()  # before the step count changes: the freshness is stored relative to it
        zero_step_counts(self)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer's persistent tensors: `state` (m, v, freshness) and `scratch` (work buffers)."""
        layout = self._ensure_layout()
        state = sum(t.numel() * t.element_size()
                    for t in (layout.exp_avg, layout.exp_avg_sq, layout.scaled_freshness))
        return {"state": state, "scratch": layout.scratch_bytes()}

    # ------------------------------------------------------------------------------------------ layout
    def _ensure_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(self.param_groups, self.state, self.min_compress_numel, self.mask,
                                   self.compress_ratio, self.beta3, self.freshness_dtype,
                                   self.state[_GLOBAL]["step"], self.rescale == "product_of_interpolations")
        return self._layout


def check_slamb_options(options: dict[str, Any]) -> None:
    """SLAMB's value checks, run by its constructor and, through the registry, on the config before any worker."""
    check_adam_hyperparameters(options)
    o = options
    require(0.0 < o["compress_ratio"] <= 1.0, "compress_ratio", o["compress_ratio"], "must be in (0, 1]")
    check_range("beta3", o["beta3"], 0.0, 1.0)
    require(isinstance(o["sync_interval"], int | float) and int(o["sync_interval"]) == o["sync_interval"] >= 1,
            "sync_interval", o["sync_interval"], "must be an integer >= 1")
    check_non_negative("min_compress_numel", o["min_compress_numel"])
    bounds = o["trust_ratio_bounds"]
    require(isinstance(bounds, Sequence) and len(bounds) == 2 and 0.0 < bounds[0] <= bounds[1],
            "trust_ratio_bounds", bounds, "must be a pair [c_min, c_max] with 0 < c_min <= c_max")
    check_choice("mask", o["mask"], _MASKS)
    check_choice("rescale", o["rescale"], _RESCALES)
    check_choice("bias_correction_form", o["bias_correction_form"], _BIAS_CORRECTION_FORMS)
    check_flags(o, "wd_in_trust_ratio", "clamp_1d")
    check_choice("stale_ratio_fallback", o["stale_ratio_fallback"], (0, 1))
    check_choice("comm_dtype", o["comm_dtype"], _COMM_DTYPES)
    check_choice("freshness_dtype", o["freshness_dtype"], _FRESHNESS_DTYPES)
    check_choice("sync_offset", o["sync_offset"], (0, 1))
    check_positive("bucket_mb", o["bucket_mb"])
    require(isinstance(o["seed"], int), "seed", o["seed"], "must be an integer")


def mask_uniforms(generator: torch.Generator, count: int, device: torch.device) -> Tensor:
    """`count` uniforms in [0, 1) from the host `generator`, on `device`: the same bits on every device.

    A CUDA generator maps its random stream to elements by the device's multiprocessor count, so ranks on
    different GPU models (or MIG slices) would draw different masks: compact vectors of different lengths (a
    hang) or unrelated coordinates averaged. The CPU generator's stream is serial (independent of threads and
    of how the draw is split). The copy goes through pinned memory, so it does not wait for the device (the
    caching host allocator keeps the block until the copy is done).
    """
    if device.type == "cpu":
        return torch.rand(count, generator=generator)
    host = torch.empty(count, pin_memory=True)
    torch.rand(count, generator=generator, out=host)
    return host.to(device, non_blocking=True)


def mask_fingerprint(masks: Sequence[_Mask]) -> tuple[int, int]:
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


def _check_masks_agree(comm: Comm, masks: Sequence[_Mask]) -> None:
    """Raise on every rank if any rank drew a mask other than rank 0's (once per run: it reads the device)."""
    mine = mask_fingerprint(masks)
    if comm.any(mine != comm.broadcast_object(mine)):
        raise RuntimeError(
            f"SLAMB: the ranks drew different sync masks at their first step (rank {comm.rank}: {mine[0]} rows, "
            f"hash {mine[1]}); every rank must run the same model, parameter order, optim.seed and optimizer "
            "options, or the momentum all-reduce would average unrelated coordinates"
        )


def _draw_size(mask: str, slot: _Slot, k: float) -> int:
    """Uniforms one masked tensor's draw takes: rows + 1 (stratified) or the Bernoulli capacity."""
    if mask == "stratified":
        return stratified_count(slot.numel // slot.block, k) + 1
    return bernoulli_capacity(slot.numel, k)


def _mask_size(mask: str, slot: _Slot, k: float) -> int:
    """Coordinates per step in one masked tensor's part of the compact vector (cyclic: the largest part)."""
    if mask == "cyclic":
        return -(-(slot.numel // slot.block) // _cyclic_parts(k)) * slot.block
    if mask == "stratified":
        return stratified_count(slot.numel // slot.block, k) * slot.block
    return bernoulli_capacity(slot.numel, k)


def _block(mask: str, numel: int) -> int:
    """Rows of the stratified and cyclic masks: up to 16 consecutive coordinates (one 64-byte cache line of
    fp32), the largest power of two dividing the tensor's size; single coordinates for Slamb_V2's Bernoulli."""
    return (min(_ROW_NUMEL, numel & -numel) or 1) if mask != "bernoulli" else 1  # 1 for an empty tensor


def _cyclic_parts(k: float) -> int:
    return max(1, math.floor(1.0 / k + 1e-9))


def _spans(chunks: list[_Chunk], masks: list[_Mask]) -> list[tuple[int, int]]:
    """Per chunk its [start, end) in the compact vector, from host-side sizes only."""
    spans, position = [], 0
    for chunk, mask in zip(chunks, masks, strict=True):
        size = mask.size(chunk)
        spans.append((position, position + size))
        position += size
    return spans


def _gather(layout: _Layout, chunk: _Chunk, mask: _Mask, out: Tensor) -> None:
    """out <- m at the chunk's synced coordinates: always-synced ones first, then the masked slots' rows."""
    m = layout.exp_avg
    always = chunk.split - chunk.start
    out[:always].copy_(m[chunk.start:chunk.split])
    mask.select(m[chunk.start:chunk.start + chunk.padded], out[always:])


def _scatter(layout: _Layout, chunk: _Chunk, mask: _Mask, values: Tensor) -> None:
    """The inverse of `_gather`: m at the synced coordinates <- the averaged values."""
    m = layout.exp_avg
    always = chunk.split - chunk.start
    m[chunk.start:chunk.split].copy_(values[:always])
    mask.put(m[chunk.start:chunk.start + chunk.padded], values[always:])


def _grad_piece(piece: _Piece, flat_grads: dict[int, Tensor]) -> Tensor:
    """The piece's fp32 gradient; a split slot's gradient is flattened (and cast) once per step, in `flat_grads`."""
    grad = piece.slot.param.grad
    if piece.whole:
        return grad if grad.dtype == torch.float32 else grad.float()
    if piece.slot.index not in flat_grads:
        flat_grads[piece.slot.index] = grad.reshape(-1).float()
    return flat_grads[piece.slot.index][piece.a:piece.b]


def _groups(slots: Sequence[tuple[int, _Slot]], piece_numel: int | None) -> list[list[_Piece]]:
    """(position in the chunk, slot) pairs cut into foreach groups of at most `piece_numel` elements, a larger
    contiguous tensor into pieces of that size (a strided one stays whole); None: one group of whole tensors."""
    if piece_numel is None:
        return [[_Piece(s, at, 0, s.numel) for at, s in slots]] if slots else []
    groups: list[list[_Piece]] = []
    room = 0
    for at, s in slots:
        size = piece_numel if s.param.is_contiguous() else max(s.numel, 1)
        for a in range(0, s.numel, size):
            b = min(a + size, s.numel)
            if b - a > room:
                groups.append([])
                room = piece_numel
            groups[-1].append(_Piece(s, at, a, b))
            room -= b - a
    return groups


def _aligned(n: int) -> int:
    """n rounded up to a multiple of `_ALIGN`."""
    return -(-n // _ALIGN) * _ALIGN


class _Layout:
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
        device = devices.pop()
        spans = self._place(param_groups, min_compress_numel, mask, _CHUNK_NUMEL.get(device.type))
        self.slots: list[_Slot] = [s for _, slots in spans for s in slots]
        by_param = {id(s.param): s for s in self.slots}
        self.slots_in_group_order = [by_param[id(p)] for p in params]
        self.numel = _aligned(max((s.offset + s.numel for s in self.slots), default=0))

        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, device=device)
        # r = beta3^(t mod R) q: q is rescaled once every R steps instead of r decaying every step (one pass
        # saved), and q is exact to fp16's 2^-11 at each write, with no error carried from step to step.
        self.rebase_interval = _rebase_interval(beta3)
        rows = max((s.row + s.rows for s in self.slots), default=0)  # one per row of the masks
        self.scaled_freshness = torch.ones(rows, dtype=freshness_dtype, device=device)
        # Work buffers, kept between steps (a fresh allocation would be page-faulted in again every step).
        # One buffer serves, in turn, as the compact vector (about k d: the momenta that are all-reduced) and,
        # once they are back in m, as each chunk's work space: its masked weights (to gather them), then its
        # direction, with the direction and the weights gathered at its selected coordinates after it.
        compact = sum(_split(slots) - slots[0].offset + sum(_mask_size(mask, s, k) for s in slots if not s.always)
                      for _, slots in spans)
        work = max((_aligned(slots[-1].offset + slots[-1].numel - slots[0].offset)
                    + 2 * sum(_mask_size(mask, s, k) for s in slots if not s.always) for _, slots in spans),
                   default=0)
        self.work = torch.empty(max(compact, work), device=device)
        self.compact = self.work[:compact]
        self.piece_numel = _PIECE_NUMEL.get(device.type)
        updates = [_groups([(at, s) for at, s in enumerate(slots) if not s.always], self.piece_numel)
                   for _, slots in spans]
        largest = max((pieces[-1].rows[1] - pieces[0].rows[0] for groups in updates for pieces in groups), default=0)
        self.coef = torch.empty(largest, device=device)  # the coefficients of one group of `updates`, per row
        self.spare = torch.empty(largest if product else 0, device=device)  # the product form's second factor
        widest = max((_span(pieces)[1] - _span(pieces)[0] for groups in updates for pieces in groups), default=0)
        # A GPU layout spreads the coefficients over the coordinates of one group of `updates`
        self.spread = torch.empty(widest if self.piece_numel is None else 0, device=device)
        self.chunks = [self._chunk(gi, slots, groups, device) for (gi, slots), groups in zip(spans, updates,
                                                                                             strict=True)]
        self.draws = _draws(mask, self.chunks, k, device)
        self.generator = torch.Generator()  # on the host whatever the device: see `mask_uniforms`
        self.cyclic: list[list[_Mask]] | None = None  # per chunk, per phase
        self.adopt(state, beta3, step)

    @staticmethod
    def _place(param_groups: list[dict[str, Any]], min_compress_numel: int, mask: str,
               limit: int | None) -> list[tuple[int, list[_Slot]]]:
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
        chunks: list[tuple[int, list[_Slot]]] = []
        offset, row = 0, 0
        for gi, current in members:
            offset, slots = _aligned(offset), []
            for p, i in current:
                if _always(p, min_compress_numel):
                    slots.append(_Slot(p, offset, p.numel(), True, i, _block(mask, p.numel()), row))
                    offset, row = offset + p.numel(), row + slots[-1].rows
            masked = sorted(((p, i) for p, i in current if not _always(p, min_compress_numel)),
                            key=lambda pair: _block(mask, pair[0].numel()))
            for p, i in masked:
                block, offset = _block(mask, p.numel()), _aligned(offset)
                if not slots or slots[-1].always or slots[-1].block != block:  # a new span: its first row
                    span_offset, span_row = offset, row
                slots.append(_Slot(p, offset, p.numel(), False, i, block, span_row + (offset - span_offset) // block))
                offset = offset + p.numel()
                row = span_row + (offset - span_offset) // block
            chunks.append((gi, slots))
        return chunks

    def _chunk(self, group: int, slots: list[_Slot], updates: list[list[_Piece]], device: torch.device) -> _Chunk:
        start, split, end = slots[0].offset, _split(slots), slots[-1].offset + slots[-1].numel
        masked = tuple(s for s in slots if not s.always)
        spans: list[_Span] = []
        bases: list[int] = []
        for j, s in enumerate(masked):
            if spans and spans[-1].block == s.block:
                last = spans[-1]
                spans[-1] = _Span(s.block, last.start, s.offset + s.numel - start, last.row, (last.slots[0], j + 1))
            else:
                spans.append(_Span(s.block, s.offset - start, s.offset + s.numel - start, s.row, (j, j + 1)))
            bases.append(s.row - spans[-1].row)
        rows = (slots[0].row, masked[0].row if masked else slots[-1].row + slots[-1].rows,
                slots[-1].row + slots[-1].rows)
        moments = [self._group(pieces, {"m": self.exp_avg, "v": self.exp_avg_sq}, start)
                   for pieces in _groups(list(enumerate(slots)), self.piece_numel)]
        return _Chunk(
            group, start, split, end, tuple(slots), masked,
            one_d=torch.tensor([s.param.dim() <= 1 for s in slots], device=device),
            spans=tuple(spans), bases=tuple(bases), rows=rows,
            directions=[s.flat(self.work, start).view_as(s.param) for s in slots], moments=tuple(moments),
            updates=tuple(self._update_group(pieces, start) for pieces in updates))

    def _group(self, pieces: list[_Piece], buffers: dict[str, Tensor], start: int) -> _Group:
        """A group with its pieces' views of the flat `buffers` and of the work space (whose element 0 is the
        chunk's first, flat position `start`) as "direction"."""
        views = {name: [piece.view(buffer, 0) for piece in pieces] for name, buffer in buffers.items()}
        views["direction"] = [piece.view(self.work, start) for piece in pieces]
        return _Group(tuple(pieces), *_span(pieces), pieces[0].rows[0], pieces[-1].rows[1], views)

    def _update_group(self, pieces: list[_Piece], start: int) -> _Group:
        """A group of masked pieces with "coef" (one coefficient per row, in the coefficient buffer from the
        group's first row) and "direction", the work space's rows (pieces of a CPU layout: the update broadcasts
        a row's coefficient over the row) or, in a GPU layout, shaped like the tensors, with "spread": the
        coefficients spread over the coordinates by one copy per segment, then one fused foreach update (a
        broadcasting foreach op would launch a kernel per tensor)."""
        first, last = pieces[0].rows[0], pieces[-1].rows[1]
        coefs = [self.coef[piece.rows[0] - first:piece.rows[1] - first].view(-1, 1) for piece in pieces]
        if self.piece_numel is not None:
            directions = [piece.view(self.work, start).view(-1, piece.slot.block) for piece in pieces]
            return _Group(tuple(pieces), *_span(pieces), first, last, {"direction": directions, "coef": coefs})
        origin = _span(pieces)[0]
        segments: list[tuple[int, int, int, int, int]] = []
        for piece in pieces:  # same-size rows of consecutive pieces are as far apart as their elements
            block, a, b = piece.slot.block, piece.slot.offset + piece.a - origin, piece.slot.offset + piece.b - origin
            row_a, row_b = piece.rows[0] - first, piece.rows[1] - first
            if segments and segments[-1][0] == block:
                segments[-1] = (block, segments[-1][1], b, segments[-1][3], row_b)
            else:
                segments.append((block, a, b, row_a, row_b))
        views = {"direction": [piece.view(self.work, start) for piece in pieces], "coef": coefs,
                 "spread": [piece.view(self.spread, origin) for piece in pieces]}
        return _Group(tuple(pieces), *_span(pieces), first, last, views, tuple(segments))

    def adopt(self, state: dict, beta3: float, step: int) -> None:
        """Copy any loaded m, v and freshness in `state` into the flat buffers, then point `state` at them.

        Freshness written per coordinate (before it was kept per row; constant over each row) is read row by row.
        """
        for slot in self.slots:
            entry = state[slot.param]
            if "freshness" in entry:  # written before q: fp32 r = q / synced_value
                entry["scaled_freshness"] = entry.pop("freshness") * self.synced_value(beta3, step)
            if "scaled_freshness" in entry and entry["scaled_freshness"].numel() == slot.numel != slot.rows:
                entry["scaled_freshness"] = entry["scaled_freshness"].reshape(-1)[::slot.block]
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
    def view(buffer: Tensor, slot: _Slot) -> Tensor:
        return slot.flat(buffer).view_as(slot.param)

    def selected(self, chunk: _Chunk, mask: _Mask) -> tuple[Tensor, Tensor]:
        """Where the direction and the weights at the selected coordinates go: the work space after the direction."""
        a, n = chunk.padded, sum(mask.sizes)
        return self.work[a:a + n], self.work[a + n:a + 2 * n]

    def gather_weights(self, chunk: _Chunk, mask: _Mask) -> None:
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
        rows = mask.rows.split([size // s.block for s, size in zip(chunk.masked, mask.sizes, strict=True)])
        for slot, base, part, selected in zip(chunk.masked, chunk.bases, parts, rows, strict=True):
            weights = slot.param.detach().reshape(-1, slot.block).float()
            torch.index_select(weights, 0, selected - base, out=part.view(-1, slot.block))

    def cyclic_masks(self, seed: int, k: float, step: int) -> list[_Mask]:
        """Phase t mod n_c of a fixed random partition of each masked tensor into n_c = floor(1/k) near-equal parts.

        Built once from the seed (each tensor's permutation of its rows from its own generator seed), per chunk
        and phase as one row list (8 bytes per row of up to 16 coordinates); only the seed goes into the state_dict.
        """
        parts = _cyclic_parts(k)
        if self.cyclic is None:
            self.cyclic = [self._cyclic_phases(chunk, seed, parts) for chunk in self.chunks]
        return [phases[step % parts] for phases in self.cyclic]

    def _cyclic_phases(self, chunk: _Chunk, seed: int, parts: int) -> list[_Mask]:
        """One chunk's mask in each phase: its masked slots' parts, in slot order, as span-relative rows."""
        phases: list[list[Tensor]] = [[] for _ in range(parts)]
        for slot, base in zip(chunk.masked, chunk.bases, strict=True):
            generator = self.generator.manual_seed(mask_seed(seed, 0x80000000 + slot.index))
            perm = torch.randperm(slot.rows, generator=generator)
            for phase, piece in enumerate(perm.tensor_split(parts)):
                phases[phase].append(piece.sort().values + base)
        device = self.exp_avg.device
        masks = []
        for rows in phases:
            sizes = [r.numel() * s.block for r, s in zip(rows, chunk.masked, strict=True)]
            flat = torch.cat(rows).to(device) if rows else torch.empty(0, dtype=torch.int64, device=device)
            masks.append(_Mask(flat, tuple(sizes), _runs(chunk.spans, sizes), None))
        return masks

    def scratch_bytes(self) -> int:
        tensors = [self.work, self.coef, self.spare, self.spread]
        tensors += [mask.rows for phases in self.cyclic or [] for mask in phases]
        tensors += [t for draw in self.draws for t in draw.constants.values() if isinstance(t, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _split(slots: list[_Slot]) -> int:
    """The end of a chunk's always-synced slots (its start if none)."""
    return max((s.offset + s.numel for s in slots if s.always), default=slots[0].offset)


def _span(pieces: list[_Piece]) -> tuple[int, int]:
    """The flat [start, end) that consecutive pieces cover."""
    return pieces[0].slot.offset + pieces[0].a, pieces[-1].slot.offset + pieces[-1].b


def _draws(mask: str, chunks: Sequence[_Chunk], k: float, device: torch.device) -> list[_Draw]:
    """The constants of every chunk's stratified or Bernoulli mask (none for the cyclic mask: fixed lists), for
    runs of consecutive chunks of at most `_DRAW_PICKS` picks (a larger chunk: alone)."""
    if mask == "cyclic":
        return []
    limit = _DRAW_PICKS.get(device.type)
    runs: list[list[tuple[_Chunk, int]]] = []  # per draw, its chunks with their picks
    total = 0
    for chunk in chunks:
        picks = sum(_mask_size(mask, s, k) // s.block for s in chunk.masked)
        if runs and (limit is None or total + picks <= limit):
            runs[-1].append((chunk, picks))
            total += picks
        else:
            runs.append([(chunk, picks)])
            total = picks
    return [_draw(mask, run, k, device) for run in runs]


def _draw(mask: str, run: Sequence[tuple[_Chunk, int]], k: float, device: torch.device) -> _Draw:
    """One draw for consecutive chunks (with their picks). Uniforms are drawn chunk by chunk, each chunk's
    masked slots in parameter order; rows come out in slot order, relative to their span."""
    tensors, sizes, runs, first = [], [], [], 0
    for chunk, _ in run:
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
        sizes.append(tuple(_mask_size(mask, s, k) for s in chunk.masked))
        runs.append(_runs(chunk.spans, sizes[-1]))
    constants = bernoulli_plan(tensors, device) if mask == "bernoulli" else stratified_plan(tensors, device)
    return _Draw(first, constants, tuple(picks for _, picks in run), tuple(sizes), tuple(runs))


def _rebase_interval(beta3: float) -> int:
    """R, the steps between rescalings of the scaled freshness q: the largest with beta3^-(R-1) <= 2^15, so that
    q (at most beta3^-(t mod R)) stays in fp16's range; 1 for beta3 = 0 (then r = q), at most 2^16."""
    if beta3 <= 0.0:
        return 1
    if beta3 >= 1.0:
        return 1 << 16
    return min(1 << 16, int(15 * math.log(2.0) / -math.log(beta3)) + 1)


def _always(p: Tensor, min_compress_numel: int) -> bool:
    return p.dim() <= 1 or p.numel() < min_compress_numel


def slamb_state_bytes(options: dict[str, Any], world_size: int) -> float:
    """m and v in fp32 and the freshness in `freshness_dtype`, one per row of the mask (rows of 16 coordinates
    for tensors whose size 16 divides; Bernoulli: single coordinates); the chunk scratch is bounded."""
    row = 1 if options["mask"] == "bernoulli" else _ROW_NUMEL
    return 8.0 + _FRESHNESS_DTYPES[options["freshness_dtype"]].itemsize / row


register_optimizer(OptimSpec(
    "slamb", SLAMB, "self", check=check_slamb_options, state_bytes_per_param=slamb_state_bytes, restart=SLAMB.restart,
    description="SLAMB (Xu et al., ICML 2023): LAMB with a randomly masked momentum all-reduce, freshness "
                "rescaling and periodic dense parameter averaging",
))
# The same class under the name of its parity preset: conf/optim/slamb_v2_official.yaml holds the official
# Slamb_V2's switches (the values live in the YAML, as for every entry; the registry adds no defaults).
register_optimizer(OptimSpec(
    "slamb_v2_official", SLAMB, "self", check=check_slamb_options, state_bytes_per_param=slamb_state_bytes,
    restart=SLAMB.restart,
    description="SLAMB with the switches of the official Slamb_V2 (decay outside the trust-ratio norms), "
                "for comparisons with the published code",
))
