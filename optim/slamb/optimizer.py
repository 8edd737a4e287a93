"""SLAMB (Xu et al., ICML 2023): LAMB whose only per-step traffic is a randomly masked average of the momentum."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from core.options import check_choice, check_non_negative, check_positive, check_range, require
from optim._compiled import CompiledMath, device_scalars, graph_chunks
from optim._math import adam_moments_, bias_corrections, closure_loss, fused_add_adam_direction_, trust_ratio
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import WIRE_DTYPES, Comm, average_tensors_
from optim.flat import pop_flat_entries
from optim.option_checks import check_adam_hyperparameters, check_flags, check_triton, use_triton
from optim.restart import load_with_current_hyperparameters, zero_step_counts
from optim.slamb._layout import FRESHNESS_DTYPES, Chunk, Layout, Scratch
from optim.slamb._masks import MASKS, ROW_NUMEL, Mask, MaskSampler, check_masks_agree

_RESCALES = ("sum_of_products", "product_of_interpolations")
_BIAS_CORRECTION_FORMS = ("scalar", "full", "none")
_GLOBAL = "slamb"  # key of the optimizer-wide entry of `self.state` (the others are parameters)
# Per-parameter state that lives in the flat buffers ("freshness": fp32 r, written before the scaled form).
_BUFFERED = ("exp_avg", "exp_avg_sq", "scaled_freshness", "freshness")


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
        beta3: freshness decay; 0.99 is the class default of [code] and [fork] (Swin config 0.999; 0.93, once
            quoted for the paper's BERT runs and unverified, did worse at CPU scale: see the BERT experiments).
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
        always_adapt: apply the trust ratios to every tensor (True: V2 and the naive class); False gives the
            tensors of param groups with ``weight_decay == 0`` (biases, LayerNorm) :math:`\phi_F = \phi_U = 1`,
            unclamped, as NVIDIA's LAMB (``optim=lamb``'s ``always_adapt``, apex ``use_nvlamb=False``): their
            step is Adam's, still rescaled by the freshness.
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
        bucket_mb: each chunk's compacted momentum and the dense parameter average go out in all-reduces of at
            most this many MB (one per bucket, never one per tensor).
        seed: seeds the masks; ranks must agree (the trainer passes the same config to every rank).
        compiled: each chunk's local pass (m, v, the direction and the norms of the weights and the direction)
            compiled by torch.compile (inductor) into one pass over memory instead of a copy, torch's fused Adam
            kernel and two norms; collectives, masks, gathers and scatters stay eager. The first step compiles, and
            the steps round apart from the eager ones within 1e-5 relative (inductor orders the norms' sums otherwise).
        triton: each chunk's local pass, weights at S_t, fresh direction with its norms, trust ratios and update in
            Triton kernels (`optim.slamb._triton`), a launch or two each however many tensors the chunk holds: the
            local pass as `compiled` fuses it (7 tensor-sized reads and writes where the aten ops take 11), the update
            forming each row's coefficient as it adds (3 where a GPU's aten ops take 5). CUDA tensors only (or
            Triton's interpreter, `TRITON_INTERPRET=1`, for tests); within 1e-5 relative of the eager steps. Not with
            `compiled`. None: the kernels where they can run (CUDA tensors, not `compiled`), the aten ops elsewhere.
        comm: the communication layer (`optim.comm.Comm`); None builds one over the default process group,
            or a world of one when there is none.

    State: per parameter ``exp_avg``, ``exp_avg_sq`` (fp32, shaped like it) and ``scaled_freshness`` (q, in
    ``freshness_dtype``, one value per row of the mask: a synced row is synced whole, so its coordinates share
    their freshness; 1-D, of numel / row size), views of flat buffers, and under the key ``"slamb"`` the step and
    the mask seed, all in `state_dict()`; masks are pure functions of (seed, step) and R of beta3, so nothing else
    is needed to resume exactly (`freshness` gives r per coordinate; a state_dict of earlier versions, with the
    fp32 ``freshness`` or a per-coordinate ``scaled_freshness``, is converted on load). Moments and,
    between dense syncs, parameters differ across ranks, so checkpoints are per rank (the trainer does this for
    ``grad_sync="self"``). Work buffers, kept between steps (`memory_bytes`): one buffer that holds, chunk by
    chunk, the chunk's direction and its compact vectors at S_t (momentum, denominators, weights, fresh
    direction: about :math:`4 k` of the chunk); and the per-row coefficients of one chunk's masked rows.

    `optim.slamb.reference` is this step one tensor at a time, for every rank in one process; the tests hold this
    class to it. Mechanics (the terms are defined in `optim.slamb._layout`): the flat buffers are cut into chunks
    (a GPU: 2^29 elements, a CPU: 2^20), each stepped whole (`_step_chunk`): torch's fused Adam kernel forms m, v
    and the direction in one pass, the chunk's momentum at S_t is all-reduced and the direction there formed again
    from it, then the ratios and the update. Each masked tensor starts at a multiple of 16 elements (at most 15
    zero elements of padding per tensor, never gathered, sent or normed) and a chunk places its masked tensors by
    row size, so one row view of a buffer over a span serves all its masked tensors of one row size: a step's mask
    (one vectorised draw per few chunks from per-tensor constants built once), the gathers and scatters at S_t,
    the freshness fill and the fresh norms (`torch._foreach_norm` over one split) cost a fixed number of calls per
    chunk, not per tensor. The update's coefficients are formed per row; a CPU broadcasts them over the rows in
    its foreach update, a GPU (`_layout.Geometry`) scales the direction's rows in place and adds it to the weights
    in one foreach op of equal shapes. A GPU step thus dispatches a number of ops independent of the number of
    tensors, and launches one kernel per foreach op, not one per tensor (each launch costs host time).
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
        always_adapt: bool = True,
        comm_dtype: str = "fp32",
        freshness_dtype: str = "fp16",
        sync_offset: int = 1,
        bucket_mb: float = 64.0,
        seed: int = 0,
        compiled: bool = False,
        triton: bool | None = False,
        comm: Comm | None = None,
    ) -> None:
        run_check("SLAMB", check_slamb_options, dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, compress_ratio=compress_ratio, beta3=beta3,
            sync_interval=sync_interval, min_compress_numel=min_compress_numel,
            trust_ratio_bounds=trust_ratio_bounds, mask=mask, rescale=rescale,
            bias_correction_form=bias_correction_form, wd_in_trust_ratio=wd_in_trust_ratio,
            stale_ratio_fallback=stale_ratio_fallback, clamp_1d=clamp_1d, always_adapt=always_adapt,
            comm_dtype=comm_dtype,
            freshness_dtype=freshness_dtype, sync_offset=sync_offset, bucket_mb=bucket_mb, seed=seed,
            compiled=compiled, triton=triton,
        ))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.compress_ratio = float(compress_ratio)
        self.beta3 = float(beta3)
        self.sync_interval = int(sync_interval)
        self.min_compress_numel = int(min_compress_numel)
        self.trust_ratio_bounds = (float(trust_ratio_bounds[0]), float(trust_ratio_bounds[1]))
        self.mask, self.rescale, self.bias_correction_form = mask, rescale, bias_correction_form
        self.wd_in_trust_ratio, self.clamp_1d = bool(wd_in_trust_ratio), bool(clamp_1d)
        self.always_adapt = bool(always_adapt)
        self.stale_ratio_fallback = float(stale_ratio_fallback)
        self.comm_dtype = WIRE_DTYPES[comm_dtype]
        self.freshness_dtype = FRESHNESS_DTYPES[freshness_dtype]
        self.sync_offset = int(sync_offset)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.compiled = bool(compiled)
        self.triton = triton  # None until the layout resolves it for the parameters' device (`use_triton`)
        self.comm = comm if comm is not None else Comm()
        self.world_size = self.comm.world_size  # read once, from the group (the official V2 starts at 1)
        self.state[_GLOBAL] = {"step": 0, "seed": int(seed)}
        self._layout: Layout | None = None
        self._sampler: MaskSampler | None = None  # built with the layout
        self._masks_agreed = False  # checked once per process, at its first multi-rank step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load m, v and the freshness straight into the flat buffers, in place, chunk by chunk.

        Torch's loader would first copy every state tensor to the parameters' device (and the fp16 freshness
        to fp32) while the buffers are alive: twice the state at once, which a 2.9B-parameter model cannot
        afford. Here only the small entries go through it; the buffers are built once (if not yet) and filled
        in place from the given tensors, wherever they are (`Layout.load_`).
        """
        if _GLOBAL not in state_dict["state"]:
            raise ValueError("SLAMB.load_state_dict: no 'slamb' entry (step, seed); not a SLAMB state_dict")
        layout = self._ensure_layout()
        small, saved = pop_flat_entries(state_dict, _BUFFERED)
        super().load_state_dict(small)
        layout.load_(self.state, saved, self.beta3, self.state[_GLOBAL]["step"])

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step, chunk by chunk (local moments and direction, masked momentum average, rescaled LAMB
        update), then the periodic dense sync.

        Nothing in it reads a tensor on the host: sizes come from the layout and the mask kind, per-tensor ratios
        stay 0-d device tensors, and choices between values are `torch.where`.
        """
        loss = closure_loss(closure)
        layout = self._ensure_layout()
        glob = self.state[_GLOBAL]
        glob["step"] += 1
        step = glob["step"]

        masks = self._sampler.masks(glob["seed"], step)
        if self.comm.distributed and not self._masks_agreed:
            check_masks_agree(self.comm, masks)
            self._masks_agreed = True
        for chunk, mask in zip(layout.chunks, masks, strict=True):
            self._step_chunk(layout, chunk, mask, step)
        if self.comm.distributed and (step - self.sync_offset) % self.sync_interval == 0:
            # the dense fp32 average of every parameter, in tensor-aligned buckets of at most bucket_mb
            average_tensors_([slot.param for slot in layout.slots], self.comm, max(1, self.bucket_bytes // 4))
        if layout.geometry.draw_ahead:
            self._sampler.draw_ahead(glob["seed"], step + 1, layout.geometry.draw_ahead)
        return loss

    def replicas_agree_after(self, step: int) -> bool:
        """Whether every rank holds the same weights after optimizer step `step` (`OptimSpec.replicas_agree_after`):
        before any step, with one rank, and right after a dense parameter average. In between each rank moves its
        own copy with its local v and the unsynced part of its m."""
        return step == 0 or not self.comm.distributed or (step - self.sync_offset) % self.sync_interval == 0

    def _step_chunk(self, layout: Layout, chunk: Chunk, mask: Mask, step: int) -> None:
        """One chunk's step: freshness; local moments and direction in one fused pass; the momentum averaged at S_t
        (one all-reduce of the chunk's compact vector) and the direction there formed again from it; fresh and
        stale trust ratios; the rescaled update.

        The direction buffer holds u~ up to a scalar `unit` (u~ = unit * buffer), folded into the norms and the
        step sizes instead of costing a pass. Where the decay enters the norms, buffer = w + (scale / lambda) m /
        (sqrt(v) + eps') with unit = lambda: the weights are copied in and torch's fused Adam kernel adds the rest
        while it updates m and v. Elsewhere buffer = m / (sqrt(v) + eps') with unit = scale, any decay added after
        the norms. Only slots with a gradient take the pass and the update.
        """
        group = self.param_groups[chunk.group]
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        bc1, bc2 = bias_corrections(step, beta1, beta2, enabled=self.bias_correction_form != "none")
        scale = math.sqrt(bc2) / bc1
        eps = group["eps"] * (math.sqrt(bc2) if self.bias_correction_form == "full" else 1.0)
        decay_in_norms = weight_decay != 0 and self.wd_in_trust_ratio
        factor, unit = (scale / weight_decay, weight_decay) if decay_in_norms else (1.0, scale)
        # A chunk holds one param group's tensors, so whether they are adapted is known on the host: no sync.
        adapt = self.always_adapt or weight_decay != 0
        to_freshness = self._refresh(layout, chunk, mask, step)
        scratch = layout.scratch(chunk, mask)

        # A chunk with a frozen or strided (channels_last) tensor steps eagerly: the fused passes take every tensor,
        # the update through row views; the Triton kernels take the chunk's weights in one dtype.
        grads = [p.grad for p in chunk.params]
        if any(g is not None and g.is_sparse for g in grads):
            raise RuntimeError("SLAMB does not support sparse gradients")
        fusable = chunk.contiguous and all(g is not None for g in grads)
        fused = ("compiled" if self.compiled and fusable else
                 "triton" if self.triton and fusable and chunk.one_dtype else None)
        norms = self._local_directions(layout, chunk, mask, scratch, grads, factor, eps, decay_in_norms, adapt, fused)
        local_norms = None
        always = len(chunk.slots) - len(chunk.masked)
        moments_at_mask = self.comm.distributed or (adapt and chunk.masked)  # the local m and v at S_t
        if fused == "triton":
            _triton_gather(layout, chunk, mask, scratch, adapt, moments_at_mask)
        elif moments_at_mask:
            layout.gather(chunk, mask, scratch.compact)
            self._denominators(layout, chunk, mask, scratch, eps)
        if adapt and chunk.masked:  # the stale norms' terms, from the local direction (see `_trust_ratios`)
            local_sums = self._fresh_direction(chunk, mask, scratch, factor, eps, decay_in_norms, fused)
            local_total = (norms[1][always:] if norms is not None
                           else torch.stack(torch._foreach_norm(chunk.directions[always:])))
            local_norms = (local_total, local_sums if fused == "triton" else _fresh_norms(mask, scratch))
        averaged_sums = always_sums = None
        if self.comm.distributed:
            self._all_reduce_mean(scratch.compact)
            layout.scatter(chunk, mask, scratch.compact)
            averaged_sums, always_sums = self._average_directions(layout, chunk, mask, scratch, factor, eps,
                                                                  decay_in_norms, fused)
        if adapt:
            weight_norms = None if norms is None else norms[0]
            always_norms = None
            if fused == "triton":  # the always-synced slots' direction norms: of the average, or of the local pass
                from optim._triton import block_norms  # imports triton: `triton_refusal` allowed it

                always_norms = (block_norms(always_sums, [s.numel for s in chunk.slots[:always]])[1]
                                if always_sums is not None else norms[1][:always])
            fresh, stale = self._trust_ratios(chunk, mask, scratch, unit, local_norms, weight_norms, averaged_sums,
                                              always_norms, fused)
        else:  # NVLAMB's plain Adam step: both ratios exactly 1, never clamped (no norms taken)
            fresh = stale = torch.ones(len(chunk.slots), device=layout.work.device)
        if weight_decay != 0 and not self.wd_in_trust_ratio:
            torch._foreach_add_(chunk.directions, chunk.params, alpha=weight_decay / scale)

        lr_fresh, lr_stale = lr * unit, lr * unit / math.sqrt(self.world_size)
        if fused == "triton" and self.rescale == "sum_of_products":  # the clamps and coefficients formed as it adds
            from optim.slamb._triton import slamb_apply_rescaled  # imports triton: `triton_refusal` allowed it

            slamb_apply_rescaled(chunk.params, chunk.directions, fresh, stale, chunk.one_d,
                                 layout.scaled_freshness[chunk.rows[1]:chunk.rows[2]], chunk.row_first,
                                 chunk.row_shift, *self.trust_ratio_bounds, self.clamp_1d, adapt, lr_fresh, lr_stale,
                                 to_freshness)
            return
        if adapt:
            fresh_clamped, stale_clamped = self._clamp_ratios(chunk, fresh, stale)
        else:
            fresh_clamped, stale_clamped = fresh, stale
        fresh_coef = fresh_clamped * -lr_fresh  # per slot, on the device: no host read
        if self.rescale == "sum_of_products":  # coef = -[lr_stale phi_U + r (lr_fresh phi_F - lr_stale phi_U)]
            stale_coef = stale_clamped * -lr_stale
            bases, slopes = stale_coef, (fresh_coef - stale_coef) * to_freshness
        else:  # naive: coef = -clamp(phi_U + r (phi_F - phi_U)) (lr_stale + r (lr_fresh - lr_stale))
            bases, slopes = stale, (fresh - stale) * to_freshness
        self._update(layout, chunk, fresh_coef, bases, slopes, (lr_stale - lr_fresh) * to_freshness, lr_stale, adapt,
                     fused)

    def _refresh(self, layout: Layout, chunk: Chunk, mask: Mask, step: int) -> float:
        """The chunk's freshness at `step` (q = 1 / to_freshness where synced now); returns to_freshness, r / q."""
        scaled, (first, split, end) = layout.scaled_freshness, chunk.rows
        if step % layout.rebase_interval == 0:  # a new epoch E = t: q <- q beta3^R keeps r = beta3^(t - E) q
            scaled[split:end].mul_(self.beta3 ** layout.rebase_interval)
        synced = layout.synced_value(self.beta3, step)  # q at a coordinate synced now (r = 1)
        scaled[first:split].fill_(synced)
        mask.fill(scaled, synced)
        return 1.0 / synced  # r = q / synced (1 to fp32 rounding where synced now), in the coefficients

    def _local_directions(self, layout: Layout, chunk: Chunk, mask: Mask, scratch: Scratch,
                          grads: list[Tensor | None], factor: float, eps: float, decay_in_norms: bool, adapt: bool,
                          fused: str | None) -> tuple[Tensor, Tensor] | None:
        """m, v and the direction buffer of the chunk's slots from their gradients `grads` (None where a slot has
        none, which `fused` excludes), by one call of torch's fused Adam kernel; and the masked weights at S_t, which
        the fresh weight norms and, with the decay in the norms, the fresh direction need. With the decay in the
        norms the weights are copied into the buffer first, which serves their gather too.

        `fused` ("compiled" or "triton"): one fused pass instead (`_fused_local_pass`), which also returns the norms
        of the weights and of the local direction per slot (eagerly, None); the weights at S_t gathered from the
        tensors (with "triton" after the pass, with m and v: `_triton_gather`)."""
        if adapt and (fused == "compiled" or (fused is None and not decay_in_norms)):
            # before the pass: a GPU's gather copies weights to the buffer
            layout.gather_weights(chunk, mask, scratch.weights, staged=False, direct=fused is not None)
        if fused:
            return self._fused_local_pass(chunk, grads, factor, eps, decay_in_norms, fused)
        if decay_in_norms:
            torch._foreach_copy_(chunk.directions, chunk.params)
            layout.gather_weights(chunk, mask, scratch.weights, staged=True)
        else:
            scratch.direction.zero_()
        active = [i for i, g in enumerate(grads) if g is not None]
        if active:
            beta1, beta2 = self.param_groups[chunk.group]["betas"]
            fused_add_adam_direction_(
                [chunk.directions[i] for i in active], [_fp32_contiguous(grads[i]) for i in active],
                [chunk.exp_avgs[i] for i in active], [chunk.exp_avg_sqs[i] for i in active],
                scale=factor, step=0, beta1=beta1, beta2=beta2, eps=eps, bias_correction=False)
        return None

    def _fused_local_pass(self, chunk: Chunk, grads: list[Tensor], factor: float, eps: float, decay_in_norms: bool,
                          fused: str) -> tuple[Tensor, Tensor]:
        """`_local_directions`' moments and direction buffer in compiled passes of a few slots each, or in Triton
        kernels over the chunk (`fused`), with the norms per slot of the weights and of the buffer: 4 tensor-sized
        reads and 3 writes (eagerly 11)."""
        beta1, beta2 = self.param_groups[chunk.group]["betas"]
        params, grads = chunk.params, [_fp32_contiguous(g) for g in grads]
        if fused == "triton":
            from optim.slamb._triton import triton_local_pass  # imports triton: only where `triton_refusal` allowed it

            return triton_local_pass(params, grads, chunk.exp_avgs, chunk.exp_avg_sqs, chunk.directions, factor, eps,
                                     beta1=beta1, beta2=beta2, decay_in_norms=decay_in_norms)
        scalars = device_scalars(chunk.exp_avgs[0].device, factor, eps)
        weight_norms, direction_norms = [], []
        for run in graph_chunks(params):
            w, u = _LOCAL_PASS(params[run], grads[run], chunk.exp_avgs[run], chunk.exp_avg_sqs[run],
                               chunk.directions[run], *scalars, beta1=beta1, beta2=beta2,
                               decay_in_norms=decay_in_norms)
            weight_norms.append(w)
            direction_norms.append(u)
        return torch.cat(weight_norms), torch.cat(direction_norms)

    def _denominators(self, layout: Layout, chunk: Chunk, mask: Mask, scratch: Scratch, eps: float) -> None:
        """sqrt(v) + eps' at S_t, laid out as the compact vector (the always-synced part only where it is averaged).
        The Triton kernels take the masked part's v instead (`_triton_gather`), and its square root as they read it."""
        a = chunk.split - chunk.start
        if a and self.comm.distributed:
            torch.sqrt(layout.exp_avg_sq[chunk.start:chunk.split], out=scratch.denominators[:a]).add_(eps)
        if chunk.masked:
            masked = scratch.denominators[a:]
            mask.select(layout.region(layout.exp_avg_sq, chunk), masked)
            masked.sqrt_().add_(eps)

    @staticmethod
    def _fresh_direction(chunk: Chunk, mask: Mask, scratch: Scratch, factor: float, eps: float, decay_in_norms: bool,
                         fused: str | None) -> Tensor | None:
        """The masked slots' direction at S_t from the momentum in the compact vector, into `scratch.fresh` (the
        fused kernel's formula, rounded apart from it by a few units in the last place). `fused` "triton": in one
        kernel, from v at S_t, which returns the block sums of its squares and of the weights' there
        (`_trust_ratios` takes them)."""
        a = chunk.split - chunk.start
        if fused == "triton":
            from optim.slamb._triton import fresh_direction_sums  # imports triton: `triton_refusal` allowed it

            return fresh_direction_sums(scratch.fresh, scratch.compact[a:], scratch.denominators[a:], scratch.weights,
                                        mask.valid, list(mask.sizes), factor, eps, decay_in_norms)
        if decay_in_norms:
            torch.addcdiv(scratch.weights, scratch.compact[a:], scratch.denominators[a:], value=factor,
                          out=scratch.fresh)
        else:
            torch.div(scratch.compact[a:], scratch.denominators[a:], out=scratch.fresh)
        return None

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
        if payload is compact and self.world_size > 1:
            compact.div_(self.world_size)
        elif payload is not compact:
            compact.copy_(payload)

    def _average_directions(self, layout: Layout, chunk: Chunk, mask: Mask, scratch: Scratch, factor: float,
                            eps: float, decay_in_norms: bool,
                            fused: str | None) -> tuple[Tensor | None, Tensor | None]:
        """The direction at S_t formed again from the averaged momentum (in `scratch.compact`), into the direction
        buffer: over the always-synced slots whole (a few short passes; with `fused` "triton" one kernel), at the
        masked slots' selected rows from the compact space (where `scratch.fresh` keeps it for the norms). Returns the
        Triton kernels' block sums: `_fresh_direction`'s and the always-synced slots' (None eagerly)."""
        always, a = len(chunk.slots) - len(chunk.masked), chunk.split - chunk.start
        always_sums = None
        if a and fused == "triton":
            from optim.slamb._triton import always_directions  # imports triton: `triton_refusal` allowed it

            always_sums = always_directions(chunk.params[:always], chunk.directions[:always],
                                            scratch.compact[:a], layout.exp_avg_sq[chunk.start:chunk.split],
                                            chunk.always_at, factor, eps, decay_in_norms)
        elif a:
            direction = scratch.direction[:a]
            if decay_in_norms:
                torch._foreach_copy_(chunk.directions[:always], chunk.params[:always])
                direction.addcdiv_(scratch.compact[:a], scratch.denominators[:a], value=factor)
            else:
                torch.div(scratch.compact[:a], scratch.denominators[:a], out=direction)
        if not chunk.masked:
            return None, always_sums
        sums = self._fresh_direction(chunk, mask, scratch, factor, eps, decay_in_norms, fused)
        mask.put(scratch.direction, scratch.fresh)
        return sums, always_sums

    def _trust_ratios(self, chunk: Chunk, mask: Mask, scratch: Scratch, unit: float,
                      local_norms: tuple[Tensor, Tensor] | None, weight_norms: Tensor | None = None,
                      averaged_sums: Tensor | None = None, always_norms: Tensor | None = None,
                      fused: str | None = None) -> tuple[Tensor, Tensor]:
        """Per slot the raw (unclamped) phi_F and phi_U over the fresh coordinates S_t and the stale rest, with
        their fallbacks for zero norms.

        Fresh norms come from the few selected coordinates, in compact buffers. The direction's stale norms are
        differences of squares of the local direction (`local_norms`), sqrt(||u||^2 - ||u_F||^2), taken before the
        averaged momentum arrives: then S_t holds values like the rest, so the difference cancels about k / (1 - k)
        of the sum. After the average it would not: at S_t the rank-averaged m meets the local v, so distinct
        gradients give u_F outliers, and ||u_F||^2 / ||u_U||^2 reached 476 and 463 at step 1 on 2 and 4 gloo
        ranks, a factor that multiplies the fp32 rounding of the difference. The weights' stale norms are a
        difference too: w has no such outliers. `weight_norms`: the slots' weight norms, where the compiled local
        pass took them. `fused` "triton": `local_norms` holds the block sums of `_fresh_direction`'s kernel, not norms,
        and `averaged_sums` those after the average (None on one rank), `always_norms` the always-synced slots'
        direction norms; the ratios are then one kernel (`optim.slamb._triton.trust_ratios`).
        """
        always = len(chunk.slots) - len(chunk.masked)  # the chunk's first slots are synced whole every step
        if fused == "triton":
            from optim.slamb._triton import trust_ratios  # imports triton: `triton_refusal` allowed it

            local_total, local_sums = local_norms or (always_norms[:0], always_norms.new_empty((2, 0)))
            ratios = trust_ratios(weight_norms, local_total, always_norms, local_sums,
                                  local_sums if averaged_sums is None else averaged_sums, list(mask.sizes), unit,
                                  self.stale_ratio_fallback)
            return ratios[0], ratios[1]
        w_total = weight_norms
        if w_total is None:
            w_total = torch.stack(torch._foreach_norm(chunk.params, 2, dtype=torch.float32))
        if not chunk.masked:  # every coordinate is fresh: phi_U is the fallback, and is never used
            u_total = torch.stack(torch._foreach_norm(chunk.directions)) * unit
            return trust_ratio(w_total, u_total), torch.full_like(w_total, self.stale_ratio_fallback)
        local_total, local_fresh = local_norms
        masked_fresh = _fresh_norms(mask, scratch) if self.comm.distributed else local_fresh
        w_selected = scratch.weights
        if mask.valid is not None:
            w_selected = w_selected * mask.valid
        u_fresh = [masked_fresh]
        if always:
            u_fresh.insert(0, torch.stack(torch._foreach_norm(chunk.directions[:always])))
        w_fresh = torch.cat([w_total[:always], torch.stack(torch._foreach_norm(w_selected.split(mask.sizes)))])
        u_fresh = torch.cat(u_fresh) * unit
        u_stale = (local_total.square() - local_fresh.square()).clamp_(min=0).sqrt_()
        u_stale = torch.cat([torch.zeros_like(w_total[:always]), u_stale]) * unit
        w_stale = (w_total.square() - w_fresh.square()).clamp_(min=0).sqrt_()
        fresh = trust_ratio(w_fresh, u_fresh)  # 1 when a norm is 0
        stale = torch.where((w_stale > 0) & (u_stale > 0), w_stale / u_stale,
                            torch.full_like(w_stale, self.stale_ratio_fallback))
        return fresh, stale

    def _update(self, layout: Layout, chunk: Chunk, fresh_coef: Tensor, bases: Tensor, slopes: Tensor,
                lr_slope: float, lr_stale: float, clamp: bool, fused: str | None) -> None:
        """w -= coef * u over the chunk's slots that have a gradient: coef per slot over the always-synced ones (r
        is 1 there: plain LAMB steps with the fresh ratio), per row over the masked ones (`_coefficients`).

        Where ops per tensor are cheap (a CPU) each row's coefficient is broadcast over its row by one foreach
        multiply-add. Elsewhere (a GPU) the direction buffer is scaled in place, by one op per span of rows and one
        over the always-synced slots, and one foreach addition of equal shapes updates every weight. `fused`:
        "compiled", the CPU's form, in compiled passes of a few tensors each (read w and u, write w); "triton", one
        kernel over the chunk that reads each row's coefficient as it adds.
        """
        always = len(chunk.slots) - len(chunk.masked)
        per_tensor = layout.geometry.per_tensor
        coef = self._coefficients(layout, chunk, bases, slopes, lr_slope, lr_stale, clamp) if chunk.masked else None
        if fused == "triton":
            from optim.slamb._triton import slamb_apply  # imports triton: only where `triton_refusal` allowed it

            slamb_apply(chunk.params, chunk.directions, fresh_coef, layout.coef, chunk.row_first,
                        chunk.row_shift)
            return
        if fused == "compiled":
            params = [s.param for s in chunk.slots[:always]] + [s.param.view(-1, s.row_size) for s in chunk.masked]
            directions = chunk.directions[:always] + chunk.direction_rows
            factors = list(fresh_coef[:always].unbind()) + chunk.coefs
            for run in graph_chunks(params):
                _APPLY(params[run], directions[run], factors[run])
            return
        if not per_tensor:
            direction = layout.work[:chunk.padded]
            if always:
                a = chunk.split - chunk.start
                direction[:a].mul_(torch.repeat_interleave(fresh_coef[:always], chunk.always_numels, output_size=a))
            for span in chunk.spans:
                rows = span.of(direction)
                first = span.row - chunk.rows[1]
                rows.mul_(coef[first:first + rows.size(0), None])
            active = [i for i, s in enumerate(chunk.slots) if s.param.grad is not None]
            if active:
                torch._foreach_add_([chunk.slots[i].param for i in active], [chunk.directions[i] for i in active])
            return
        if always:
            coefs = fresh_coef.unbind()
            active = [i for i, s in enumerate(chunk.slots[:always]) if s.param.grad is not None]
            torch._foreach_addcmul_([chunk.slots[i].param for i in active], [chunk.directions[i] for i in active],
                                    [coefs[i] for i in active])
        active = [j for j, s in enumerate(chunk.masked) if s.param.grad is not None]
        contiguous = [j for j in active if chunk.masked[j].param.is_contiguous()]
        if contiguous:
            torch._foreach_addcmul_([chunk.masked[j].param.view(-1, chunk.masked[j].row_size) for j in contiguous],
                                    [chunk.direction_rows[j] for j in contiguous], [chunk.coefs[j] for j in contiguous])
        strided = [j for j in active if not chunk.masked[j].param.is_contiguous()]
        if strided:  # a strided parameter (channels_last) has no row view: scale the direction's rows, then add
            torch._foreach_mul_([chunk.direction_rows[j] for j in strided], [chunk.coefs[j] for j in strided])
            torch._foreach_add_([chunk.masked[j].param for j in strided],
                                [chunk.directions[always + j] for j in strided])

    def _coefficients(self, layout: Layout, chunk: Chunk, bases: Tensor, slopes: Tensor, lr_slope: float,
                      lr_stale: float, clamp: bool) -> Tensor:
        """The update's coefficient of each of the chunk's masked rows, from the rescale form.

        The freshness, hence the coefficient, is constant over a row of the mask, so the coefficients are formed
        per row (a sixteenth of the work per coordinate): q times the per-slot slope plus the per-slot base, and for
        the product form three passes more. Where ops per tensor are cheap (a CPU) q is copied to fp32 and the slope
        and base are 0-d factors of foreach ops over the slots' rows; elsewhere both are spread over the rows first,
        as the columns of one tensor (`Layout.per_row`), for one multiply-add. `slopes` and `lr_slope` are per unit
        of q; `clamp`: the product form clamps its interpolated ratio (not where the tensors are not adapted: their
        ratio is exactly 1).
        """
        scaled = layout.scaled_freshness[chunk.rows[1]:chunk.rows[2]]
        coef = layout.coef[:scaled.numel()]
        if layout.geometry.per_tensor:
            coef.copy_(scaled)  # to fp32 first: a product with a 0-d fp32 tensor would be computed in q's dtype
            always = len(chunk.slots) - len(chunk.masked)
            torch._foreach_mul_(chunk.coefs, slopes[always:].unbind())
            torch._foreach_add_(chunk.coefs, bases[always:].unbind())
        else:  # in fp32: the spread factors are not 0-d
            spread = layout.per_row(chunk, torch.stack([slopes, bases], 1))
            torch.addcmul(spread[:, 1], scaled, spread[:, 0], out=coef)
        if self.rescale == "product_of_interpolations":  # interpolate the raw ratios, clamp, times the mixed lr
            if clamp:
                coef.clamp_(*self.trust_ratio_bounds)  # a masked tensor is never 1-D: clamp_1d does not apply
            # ratio (-lr_stale - r (lr_fresh - lr_stale)), in two passes through the second buffer
            spare = layout.spare[:coef.numel()]
            torch.mul(coef, -lr_stale, out=spare)
            torch.addcmul(spare, coef, scaled, value=lr_slope, out=coef)
        return coef

    def _clamp_ratios(self, chunk: Chunk, fresh: Tensor, stale: Tensor) -> tuple[Tensor, Tensor]:
        """phi_F clamped to [c_min, c_max] and phi_U to [0, c_max] (1-D tensors left alone without clamp_1d)."""
        c_min, c_max = self.trust_ratio_bounds
        fresh_clamped, stale_clamped = fresh.clamp(c_min, c_max), stale.clamp(0.0, c_max)
        if not self.clamp_1d:
            fresh_clamped = torch.where(chunk.one_d, fresh, fresh_clamped)
            stale_clamped = torch.where(chunk.one_d, stale, stale_clamped)
        return fresh_clamped, stale_clamped

    # ------------------------------------------------------------------------------------------ masks
    def sync_masks(self, step: int) -> list[Tensor]:
        """The boolean mask S_`step` of every parameter (param_groups order): which coordinates that step averages.

        A pure function of the seed and the step (the same on every rank); for tests and analysis.
        """
        layout = self._ensure_layout()
        flat = torch.zeros(layout.numel, dtype=torch.bool, device=layout.exp_avg.device)
        for chunk, mask in zip(layout.chunks, self._sampler.masks(self.state[_GLOBAL]["seed"], step), strict=True):
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
        return [(self.state[s.param]["scaled_freshness"].float() * to_freshness).repeat_interleave(s.row_size)
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
        return {"state": layout.state_bytes(), "scratch": layout.scratch_bytes() + self._sampler.scratch_bytes()}

    # ------------------------------------------------------------------------------------------ layout
    def _ensure_layout(self) -> Layout:
        if self._layout is None:
            device = self.param_groups[0]["params"][0].device
            self.triton = use_triton(self.triton, device, "SLAMB", self.compiled)
            self._layout = Layout(self.param_groups, self.state, self.min_compress_numel, self.mask,
                                  self.compress_ratio, self.beta3, self.freshness_dtype,
                                  self.rescale == "product_of_interpolations")
            self._sampler = MaskSampler(self.mask, self.compress_ratio, self._layout.chunks, self._layout.device,
                                        self._layout.geometry.draw_picks)
        return self._layout


def _triton_gather(layout: Layout, chunk: Chunk, mask: Mask, scratch: Scratch, weights: bool, moments: bool) -> None:
    """The Triton step's values at S_t, after the local pass: the masked weights (`weights`) and the local m and v
    (`moments`: m's always-synced part copied, the masked rows of m and of v gathered) in one row gather."""
    from optim.slamb._triton import triton_gather_at_mask  # imports triton: `triton_refusal` allowed it

    a = chunk.split - chunk.start
    if moments:
        scratch.compact[:a].copy_(layout.exp_avg[chunk.start:chunk.split])
    triton_gather_at_mask(chunk, mask, scratch.weights if weights else None,
                          (scratch.compact[a:], scratch.denominators[a:]) if moments else None)


def _local_pass(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                directions: list[Tensor], factor: Tensor, eps: Tensor, *, beta1: float, beta2: float,
                decay_in_norms: bool) -> tuple[Tensor, Tensor]:
    """The compiled local pass: m and v from g, the buffer `[w +] factor m / (sqrt(v) + eps)` (the fused Adam
    kernel's formula), and per tensor the norms of w and of the buffer."""
    weight_norms, direction_norms = [], []
    for w, g, m, v, u in zip(params, grads, exp_avgs, exp_avg_sqs, directions, strict=True):
        adam_moments_(m, v, g, beta1, beta2)
        step = m / (v.sqrt() + eps) * factor
        u.copy_(w.float() + step if decay_in_norms else step)
        weight_norms.append(torch.linalg.vector_norm(w, dtype=torch.float32))
        direction_norms.append(torch.linalg.vector_norm(u))
    return torch.stack(weight_norms), torch.stack(direction_norms)


def _apply(params: list[Tensor], directions: list[Tensor], factors: list[Tensor]) -> None:
    """The compiled update: `w += factor * u`, a factor per tensor (0-d) or per row of it (a column)."""
    for w, u, factor in zip(params, directions, factors, strict=True):
        w.add_(u * factor)


# Store the new moments once and let the buffer and its norm read them in the same loop (as LAMB's first pass).
_LOCAL_PASS = CompiledMath(_local_pass, options={"realize_reads_threshold": 1})
_APPLY = CompiledMath(_apply)


def _fresh_norms(mask: Mask, scratch: Scratch) -> Tensor:
    """Per masked slot the norm of its direction at S_t (`scratch.fresh`)."""
    fresh = scratch.fresh
    if mask.valid is not None:  # padding duplicates a selected coordinate: count it once
        fresh = fresh * mask.valid
    return torch.stack(torch._foreach_norm(fresh.split(mask.sizes)))


def _fp32_contiguous(grad: Tensor) -> Tensor:
    """A gradient in fp32, laid out as its moments' views (contiguous), as the fused kernel reads it."""
    return grad.float().contiguous()


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
    check_choice("mask", o["mask"], MASKS)
    check_choice("rescale", o["rescale"], _RESCALES)
    check_choice("bias_correction_form", o["bias_correction_form"], _BIAS_CORRECTION_FORMS)
    check_flags(o, "wd_in_trust_ratio", "clamp_1d", "always_adapt", "compiled")
    check_triton(o)
    check_choice("stale_ratio_fallback", o["stale_ratio_fallback"], (0, 1))
    check_choice("comm_dtype", o["comm_dtype"], WIRE_DTYPES)
    check_choice("freshness_dtype", o["freshness_dtype"], FRESHNESS_DTYPES)
    check_choice("sync_offset", o["sync_offset"], (0, 1))
    check_positive("bucket_mb", o["bucket_mb"])
    require(isinstance(o["seed"], int), "seed", o["seed"], "must be an integer")




def slamb_state_bytes(options: dict[str, Any], world_size: int) -> float:
    """m and v in fp32 and the freshness in `freshness_dtype`, one per row of the mask (rows of 16 coordinates
    for tensors whose size 16 divides; Bernoulli: single coordinates); the chunk scratch is bounded."""
    row = 1 if options["mask"] == "bernoulli" else ROW_NUMEL
    return 8.0 + FRESHNESS_DTYPES[options["freshness_dtype"]].itemsize / row


register_optimizer(OptimSpec(
    "slamb", SLAMB, "self", check=check_slamb_options, state_bytes_per_param=slamb_state_bytes, restart=SLAMB.restart,
    replicas_agree_after=SLAMB.replicas_agree_after,
    description="SLAMB (Xu et al., ICML 2023): LAMB with a randomly masked momentum all-reduce, freshness "
                "rescaling and periodic dense parameter averaging",
))
# The same class under the name of its parity preset: conf/optim/slamb_v2_official.yaml holds the official
# Slamb_V2's switches (the values live in the YAML, as for every entry; the registry adds no defaults).
register_optimizer(OptimSpec(
    "slamb_v2_official", SLAMB, "self", check=check_slamb_options, state_bytes_per_param=slamb_state_bytes,
    restart=SLAMB.restart, replicas_agree_after=SLAMB.replicas_agree_after,
    description="SLAMB with the switches of the official Slamb_V2 (decay outside the trust-ratio norms), "
                "for comparisons with the published code",
))

