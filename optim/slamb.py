"""SLAMB (Xu et al., ICML 2023): LAMB whose only per-step traffic is a randomly masked average of the momentum."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from conf.checks import check_choice, check_non_negative, check_positive, check_range, require
from optim._math import (
    bias_corrections,
    check_adam_hyperparameters,
    check_flags,
    closure_loss,
    foreach_adam_moments_,
    trust_ratio,
)
from optim._registry import OptimSpec, register_optimizer, run_check
from optim.comm import Comm

_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_MASKS = ("bernoulli", "cyclic")
_RESCALES = ("sum_of_products", "product_of_interpolations")
_BIAS_CORRECTION_FORMS = ("scalar", "full", "none")
# Elements per chunk of the flat buffers, by device type (absent: a whole param group). On the CPU the passes
# of one chunk stay in cache (see optim/lamb.py's _FOREACH_CHUNK_NUMEL); on a GPU it bounds the scratch buffer.
_CHUNK_NUMEL = {"cpu": 1 << 20, "cuda": 1 << 26}
_GLOBAL = "slamb"  # key of the optimizer-wide entry of `self.state` (the others are parameters)


@dataclass(frozen=True)
class _Slot:
    """Where one parameter's moments and freshness live in the flat buffers."""

    param: Tensor
    offset: int
    numel: int
    always: bool  # 1-D or smaller than min_compress_numel: synced every step


@dataclass(frozen=True)
class _Chunk:
    """Consecutive slots of one param group: always-synced ones in [start, split), masked ones in [split, end)."""

    group: int
    start: int
    split: int
    end: int
    slots: tuple[_Slot, ...]
    masked_start: int  # offset of [split, end) among all masked coordinates (the cyclic phase table)


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
    ``bernoulli``: each coordinate independently with probability ``compress_ratio`` (drawn as geometric gaps
    between selected coordinates, O(k d) random numbers per step). ``cyclic``: a fixed random partition of the
    coordinates into :math:`\lfloor 1/k\rfloor` chunks, chunk :math:`t \bmod n_c` at step :math:`t`.

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
        mask: ``"bernoulli"`` (Slamb_V2) or ``"cyclic"`` (Slamb).
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
            range), the backend sums half-precision values (partial sums rounded to the wire dtype, not fp32), and
            the mean is cast back into the fp32 momentum; the bytes counted are the half-precision payload's, 2 per synced coordinate.
        sync_offset: dense sync when :math:`(t - \text{sync\_offset}) \bmod H = 0`; 1 as in [code].
        bucket_mb: the compacted momentum and the dense parameter average go out in all-reduces of at most
            this many MB (one per bucket, never one per tensor).
        seed: seeds the masks; ranks must agree (the trainer passes the same config to every rank).
        comm: the communication layer (`optim.comm.Comm`); None builds one over the default process group,
            or a world of one when there is none.

    State: per parameter ``exp_avg``, ``exp_avg_sq`` and ``freshness`` (fp32 views of flat buffers), and under
    the key ``"slamb"`` the step and the mask seed, all in `state_dict()`. Moments and, between dense syncs,
    parameters differ across ranks, so checkpoints are per rank (the trainer does this for ``grad_sync="self"``).
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
        mask: str = "bernoulli",
        rescale: str = "sum_of_products",
        bias_correction_form: str = "scalar",
        wd_in_trust_ratio: bool = True,
        stale_ratio_fallback: float = 0.0,
        clamp_1d: bool = True,
        comm_dtype: str = "fp32",
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
            sync_offset=sync_offset, bucket_mb=bucket_mb, seed=seed,
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
        self.sync_offset = int(sync_offset)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.comm = comm if comm is not None else Comm()
        self.world_size = self.comm.world_size  # read once, from the group (the official V2 starts at 1)
        self.state[_GLOBAL] = {"step": 0, "seed": int(seed)}
        self._layout: _Layout | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, then rebuild the flat buffers from the loaded per-parameter tensors at the next use."""
        super().load_state_dict(state_dict)
        if _GLOBAL not in self.state:
            raise ValueError("SLAMB.load_state_dict: no 'slamb' entry (step, seed); not a SLAMB state_dict")
        self._layout = None

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SLAMB step: local moments, masked momentum average, rescaled LAMB update, periodic dense sync."""
        loss = closure_loss(closure)
        layout = self._ensure_layout()
        glob = self.state[_GLOBAL]
        glob["step"] += 1
        step = glob["step"]

        # Chunk by chunk, so that each gather and scatter follows the pass that brought its data into cache.
        synced = self._synced_indices(layout, step)  # cheap: about k d random numbers
        compact = self._compact_buffer(layout, synced) if self.comm.distributed else None
        spans = self._compact_spans(layout, synced)
        for chunk, idx, span in zip(layout.chunks, synced, spans, strict=True):
            self._local_moments(layout, chunk)
            if compact is not None:
                self._gather_momentum(layout, chunk, idx, compact, span)
        if compact is not None:
            self._all_reduce_mean(compact)
        for chunk, idx, span in zip(layout.chunks, synced, spans, strict=True):
            if compact is not None:
                self._scatter_momentum(layout, chunk, idx, compact, span)
            self._update_chunk(layout, chunk, idx, step)
        if self.comm.distributed and (step - self.sync_offset) % self.sync_interval == 0:
            self._average_parameters(layout)
        return loss

    def _local_moments(self, layout: _Layout, chunk: _Chunk) -> None:
        slots = [s for s in chunk.slots if s.param.grad is not None]
        if not slots:
            return
        for s in slots:
            if s.param.grad.is_sparse:
                raise RuntimeError("SLAMB does not support sparse gradients")
        beta1, beta2 = self.param_groups[chunk.group]["betas"]
        grads = [s.param.grad if s.param.grad.dtype == torch.float32 else s.param.grad.float() for s in slots]
        foreach_adam_moments_(
            [layout.view(layout.exp_avg, s) for s in slots], [layout.view(layout.exp_avg_sq, s) for s in slots],
            grads, beta1, beta2,
        )

    # The momentum sync, m[S_t] <- rank mean of m[S_t]: the synced coordinates of all chunks are gathered into
    # one compact vector, all-reduced in buckets of at most bucket_mb, and scattered back.
    @staticmethod
    def _compact_spans(layout: _Layout, synced: list[Tensor]) -> list[tuple[int, int, int]]:
        """Per chunk (position in the compact vector, always-synced count, masked count)."""
        spans, pos = [], 0
        for chunk, idx in zip(layout.chunks, synced, strict=True):
            spans.append((pos, chunk.split - chunk.start, idx.numel()))
            pos += chunk.split - chunk.start + idx.numel()
        return spans

    def _compact_buffer(self, layout: _Layout, synced: list[Tensor]) -> Tensor:
        total = sum(c.split - c.start + idx.numel() for c, idx in zip(layout.chunks, synced, strict=True))
        return torch.empty(total, dtype=torch.float32, device=layout.exp_avg.device)

    @staticmethod
    def _gather_momentum(layout: _Layout, chunk: _Chunk, idx: Tensor, compact: Tensor, span: tuple) -> None:
        pos, always, masked = span
        m = layout.exp_avg[chunk.start:chunk.end]
        compact[pos:pos + always].copy_(m[:always])
        torch.index_select(m, 0, idx, out=compact[pos + always:pos + always + masked])

    @staticmethod
    def _scatter_momentum(layout: _Layout, chunk: _Chunk, idx: Tensor, compact: Tensor, span: tuple) -> None:
        pos, always, masked = span
        m = layout.exp_avg[chunk.start:chunk.end]
        m[:always].copy_(compact[pos:pos + always])
        m.index_copy_(0, idx, compact[pos + always:pos + always + masked])

    def _all_reduce_mean(self, compact: Tensor) -> None:
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

    def _update_chunk(self, layout: _Layout, chunk: _Chunk, synced: Tensor, step: int) -> None:
        """Freshness, Adam direction, fresh/stale trust ratios and the rescaled update of one chunk."""
        start, end = chunk.start, chunk.end
        layout.freshness[chunk.split:end].mul_(self.beta3)
        layout.freshness[start:end].index_fill_(0, synced, 1.0)

        slots = [s for s in chunk.slots if s.param.grad is not None]
        if not slots:
            return
        group = self.param_groups[chunk.group]
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        bc1, bc2 = bias_corrections(step, beta1, beta2, enabled=self.bias_correction_form != "none")
        # u' = m / (sqrt(v) + eps') is the direction up to the scalar `scale`, which is folded into the norms
        # and the step size instead of costing a pass over the chunk.
        scale = math.sqrt(bc2) / bc1
        eps = group["eps"] * (math.sqrt(bc2) if self.bias_correction_form == "full" else 1.0)
        direction = layout.scratch[:end - start]
        torch.sqrt(layout.exp_avg_sq[start:end], out=direction)
        direction.add_(eps)
        torch.div(layout.exp_avg[start:end], direction, out=direction)
        params = [s.param for s in slots]
        updates = [direction[s.offset - start:s.offset - start + s.numel].view_as(s.param) for s in slots]
        if weight_decay != 0 and self.wd_in_trust_ratio:
            torch._foreach_add_(updates, params, alpha=weight_decay / scale)

        fresh_raw, stale_raw, has_stale = self._trust_ratios(chunk, slots, synced, direction, scale)
        fresh_ratio, stale_ratio = self._clamp_ratios(slots, fresh_raw, stale_raw)
        if weight_decay != 0 and not self.wd_in_trust_ratio:
            torch._foreach_add_(updates, params, alpha=weight_decay / scale)

        lr_fresh, lr_stale = lr * scale, lr * scale / math.sqrt(self.world_size)
        fresh_coef = fresh_ratio * lr_fresh  # per tensor, 0-d tensors on the device: no host sync
        stale_coef = torch.where(has_stale, stale_ratio * lr_stale, torch.zeros_like(stale_ratio))
        always = [i for i, s in enumerate(slots) if s.always]
        if always:  # r == 1 on every coordinate: plain LAMB steps with the fresh ratio
            torch._foreach_addcmul_([params[i] for i in always], [updates[i] for i in always],
                                    list((-fresh_coef[always]).unbind()))
        for i, s in enumerate(slots):
            if s.always:
                continue
            r = layout.view(layout.freshness, s)
            coef = layout.coef[:s.numel].view_as(s.param)  # a persistent buffer: no page faults per step
            if self.rescale == "sum_of_products":
                torch.addcmul(stale_coef[i], r, fresh_coef[i] - stale_coef[i], out=coef)
            else:
                # The naive form interpolates the raw ratios and clamps the result (not the clamped ratios).
                ratio = torch.addcmul(stale_raw[i], r, fresh_raw[i] - stale_raw[i])
                if self.clamp_1d or s.param.dim() > 1:
                    ratio.clamp_(*self.trust_ratio_bounds)
                torch.mul(r, lr_fresh - lr_stale, out=coef).add_(lr_stale).mul_(ratio)
            s.param.addcmul_(updates[i], coef, value=-1.0)

    def _trust_ratios(
        self, chunk: _Chunk, slots: list[_Slot], synced: Tensor, direction: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Per tensor the raw (unclamped) phi_F and phi_U over the fresh coordinates S_t and the stale rest, with
        their fallbacks for zero norms, and whether the tensor has stale coordinates."""
        params = [s.param for s in slots]
        updates = [direction[s.offset - chunk.start:s.offset - chunk.start + s.numel] for s in slots]
        w_total = torch.stack(torch._foreach_norm(params, 2, dtype=torch.float32))
        u_total = torch.stack(torch._foreach_norm(updates)) * scale
        w_fresh, u_fresh = w_total.clone(), u_total.clone()
        has_stale = torch.zeros(len(slots), dtype=torch.bool, device=w_total.device)

        masked = [i for i, s in enumerate(slots) if not s.always]
        if masked:
            # Fresh norms from the few synced coordinates; stale ones by difference (no pass over the stale 90%).
            starts = [slots[i].offset - chunk.start for i in masked]
            bounds = [edge for i, a in zip(masked, starts, strict=True) for edge in (a, a + slots[i].numel)]
            cuts = torch.searchsorted(synced, torch.tensor(bounds, device=synced.device)).tolist()  # host sync
            u_parts, w_parts, stale = [], [], []
            for j, i in enumerate(masked):
                a, b = cuts[2 * j], cuts[2 * j + 1]
                u_parts.append(direction.index_select(0, synced[a:b]))
                w_parts.append(slots[i].param.reshape(-1).index_select(0, synced[a:b] - starts[j]))
                stale.append(b - a < slots[i].numel)
            where = torch.tensor(masked, device=w_total.device)
            w_fresh[where] = torch.stack(torch._foreach_norm(w_parts, 2, dtype=torch.float32))
            u_fresh[where] = torch.stack(torch._foreach_norm(u_parts)) * scale
            has_stale[where] = torch.tensor(stale, device=w_total.device)
        w_stale = (w_total.square() - w_fresh.square()).clamp_(min=0).sqrt_()
        u_stale = (u_total.square() - u_fresh.square()).clamp_(min=0).sqrt_()
        w_stale = torch.where(has_stale, w_stale, torch.zeros_like(w_stale))
        u_stale = torch.where(has_stale, u_stale, torch.zeros_like(u_stale))

        fresh = trust_ratio(w_fresh, u_fresh)  # 1 when a norm is 0
        stale = torch.where((w_stale > 0) & (u_stale > 0), w_stale / u_stale,
                            torch.full_like(w_stale, self.stale_ratio_fallback))
        return fresh, stale, has_stale

    def _clamp_ratios(self, slots: list[_Slot], fresh: Tensor, stale: Tensor) -> tuple[Tensor, Tensor]:
        """phi_F clamped to [c_min, c_max] and phi_U to [0, c_max] (1-D tensors left alone without clamp_1d)."""
        c_min, c_max = self.trust_ratio_bounds
        fresh_clamped, stale_clamped = fresh.clamp(c_min, c_max), stale.clamp(0.0, c_max)
        if not self.clamp_1d:
            one_d = torch.tensor([s.param.dim() <= 1 for s in slots], device=fresh.device)
            fresh_clamped = torch.where(one_d, fresh, fresh_clamped)
            stale_clamped = torch.where(one_d, stale, stale_clamped)
        return fresh_clamped, stale_clamped

    def _average_parameters(self, layout: _Layout) -> None:
        """Dense fp32 average of every parameter, in tensor-aligned buckets of at most bucket_mb."""
        bucket: list[Tensor] = []
        numel = 0
        for slot in layout.slots:
            if bucket and 4 * (numel + slot.numel) > self.bucket_bytes:
                self._average_bucket(bucket)
                bucket, numel = [], 0
            bucket.append(slot.param)
            numel += slot.numel
        if bucket:
            self._average_bucket(bucket)

    def _average_bucket(self, params: list[Tensor]) -> None:
        flat = torch.cat([p.detach().reshape(-1).float() for p in params])
        self.comm.all_reduce(flat)
        flat.div_(self.world_size)
        for p, value in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.copy_(value.view_as(p))

    # ------------------------------------------------------------------------------------------ masks
    def _synced_indices(self, layout: _Layout, step: int) -> list[Tensor]:
        """Per chunk, the sorted indices (from the chunk's start) of its masked coordinates in S_t.

        The chunk's always-synced coordinates, [start, split), are in S_t too, implicitly.
        """
        k = self.compress_ratio
        seed = self.state[_GLOBAL]["seed"]
        if self.mask == "cyclic":
            table, count = layout.cyclic_phases(seed, k)
            current = step % count
            return [
                torch.nonzero(table[c.masked_start:c.masked_start + c.end - c.split] == current).squeeze(1)
                .add_(c.split - c.start)
                for c in layout.chunks
            ]
        generator = layout.generator
        generator.manual_seed(_mask_seed(seed, step))
        return [_bernoulli_positions(c.end - c.split, k, generator, c.split - c.start) for c in layout.chunks]

    def sync_masks(self, step: int) -> list[Tensor]:
        """The boolean mask S_`step` of every parameter (param_groups order): which coordinates that step averages.

        A pure function of the seed and the step (the same on every rank); for tests and analysis.
        """
        layout = self._ensure_layout()
        flat = torch.zeros(layout.numel, dtype=torch.bool, device=layout.exp_avg.device)
        for chunk, idx in zip(layout.chunks, self._synced_indices(layout, step), strict=True):
            flat[chunk.start:chunk.split] = True
            flat[chunk.start + idx] = True
        return [flat[s.offset:s.offset + s.numel].view_as(s.param) for s in layout.slots_in_group_order]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer's persistent tensors: `state` (m, v, freshness) and `scratch` (work buffers)."""
        layout = self._ensure_layout()
        state = sum(t.numel() * t.element_size() for t in (layout.exp_avg, layout.exp_avg_sq, layout.freshness))
        scratch = (layout.scratch.numel() + layout.coef.numel()) * layout.scratch.element_size()
        if layout.phases is not None:
            scratch += layout.phases.numel() * layout.phases.element_size()
        return {"state": state, "scratch": scratch}

    # ------------------------------------------------------------------------------------------ layout
    def _ensure_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout(self.param_groups, self.state, self.min_compress_numel)
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
    check_choice("sync_offset", o["sync_offset"], (0, 1))
    check_positive("bucket_mb", o["bucket_mb"])
    require(isinstance(o["seed"], int), "seed", o["seed"], "must be an integer")


def _mask_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step): splitmix64 of both, so nearby seeds give unrelated masks."""
    x = ((seed & 0xFFFFFFFF) << 32 | (step & 0xFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) >> 1


def _bernoulli_positions(n: int, k: float, generator: torch.Generator, offset: int) -> Tensor:
    """Sorted positions `offset + i`, i in [0, n), each present independently with probability k.

    The gaps between successive Bernoulli(k) successes are i.i.d. Geometric(k), so drawing the gaps
    (inverse CDF of uniforms: floor(log(1 - U) / log(1 - k)) + 1) costs about k n random numbers instead of n,
    and gives the indices the gather needs without a pass over a dense mask.
    """
    device = generator.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    if k >= 1.0:
        return torch.arange(offset, offset + n, device=device)
    log_q = math.log1p(-k)
    mean = n * k
    batch = int(mean + 6.0 * math.sqrt(mean * (1.0 - k)) + 32)
    pieces, next_position = [], offset
    while True:
        uniform = torch.rand(batch, generator=generator, device=device)
        # 1 - U lies in (0, 1], so its log is finite; log is vectorised where log1p is not (10x on the CPU).
        gaps = uniform.neg_().add_(1.0).log_().div_(log_q).floor_().to(torch.int64).add_(1)
        positions = gaps.cumsum_(0).add_(next_position - 1)
        last = int(positions[-1])
        if last >= offset + n:
            count = int(torch.searchsorted(positions, offset + n))
            pieces.append(positions[:count])
            break
        pieces.append(positions)
        next_position = last + 1
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class _Layout:
    """Flat fp32 buffers for m, v and freshness, with every parameter's state a view into them.

    Order: param group by param group, always-synced tensors first, so that each chunk's always-synced
    coordinates are one slice and its masked ones another.
    """

    def __init__(self, param_groups: list[dict[str, Any]], state: dict, min_compress_numel: int) -> None:
        params = [p for g in param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"SLAMB needs all parameters on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        limit = _CHUNK_NUMEL.get(device.type)
        self.slots: list[_Slot] = []
        self.chunks: list[_Chunk] = []
        by_param: dict[int, _Slot] = {}
        offset = masked_offset = 0
        for gi, group in enumerate(param_groups):
            ordered = sorted(group["params"], key=lambda p: not _always(p, min_compress_numel))  # stable
            current: list[_Slot] = []
            for p in ordered:
                numel = p.numel()
                if current and limit is not None and offset + numel - current[0].offset > limit:
                    masked_offset = self._close(gi, current, masked_offset)
                    current = []
                slot = _Slot(p, offset, numel, _always(p, min_compress_numel))
                current.append(slot)
                by_param[id(p)] = slot
                offset += numel
            if current:
                masked_offset = self._close(gi, current, masked_offset)
        self.numel, self.masked_numel = offset, masked_offset
        self.slots_in_group_order = [by_param[id(p)] for p in params]

        self.exp_avg = torch.zeros(offset, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32, device=device)
        self.freshness = torch.ones(offset, dtype=torch.float32, device=device)
        self.scratch = torch.empty(max((c.end - c.start for c in self.chunks), default=0), device=device)
        self.coef = torch.empty(max((s.numel for s in self.slots if not s.always), default=0), device=device)
        self.generator = torch.Generator(device=device)
        self.phases: Tensor | None = None  # cyclic mask: per masked coordinate, the step mod n_c that syncs it
        for slot in self.slots:  # adopt loaded state, then point the state at the flat buffers
            entry = state[slot.param]
            for key, buffer in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq),
                                ("freshness", self.freshness)):
                view = self.view(buffer, slot)
                if key in entry:
                    if entry[key].shape != view.shape:
                        raise ValueError(f"SLAMB: loaded {key} of shape {tuple(entry[key].shape)} for a parameter "
                                         f"of shape {tuple(view.shape)}")
                    view.copy_(entry[key])
                entry[key] = view

    def _close(self, group: int, slots: list[_Slot], masked_offset: int) -> int:
        split = next((s.offset for s in slots if not s.always), slots[-1].offset + slots[-1].numel)
        end = slots[-1].offset + slots[-1].numel
        self.chunks.append(_Chunk(group, slots[0].offset, split, end, tuple(slots), masked_offset))
        self.slots.extend(slots)
        return masked_offset + end - split

    @staticmethod
    def view(buffer: Tensor, slot: _Slot) -> Tensor:
        return buffer[slot.offset:slot.offset + slot.numel].view_as(slot.param)

    def cyclic_phases(self, seed: int, k: float) -> tuple[Tensor, int]:
        """(table, n_c): a random partition of the masked coordinates into n_c = floor(1/k) near-equal chunks.

        Built once from the seed, as one small integer per coordinate (the chunk it belongs to) rather than the
        official int32 permutation (4 bytes per parameter); only the seed goes into the state_dict.
        """
        count = max(1, math.floor(1.0 / k + 1e-9))
        if self.phases is None:
            dtype = torch.uint8 if count <= 256 else torch.int32
            device = self.exp_avg.device
            generator = torch.Generator(device=device).manual_seed(_mask_seed(seed, 0xFFFFFFFF))
            n = self.masked_numel
            perm = torch.randperm(n, generator=generator, device=device)
            self.phases = torch.empty(n, dtype=dtype, device=device)
            self.phases[perm] = (torch.arange(n, device=device) * count // max(n, 1)).to(dtype)
        return self.phases, count


def _always(p: Tensor, min_compress_numel: int) -> bool:
    return p.dim() <= 1 or p.numel() < min_compress_numel


register_optimizer(OptimSpec(
    "slamb", SLAMB, "self", check=check_slamb_options,
    description="SLAMB (Xu et al., ICML 2023): LAMB with a randomly masked momentum all-reduce, freshness "
                "rescaling and periodic dense parameter averaging",
))
# The same class under the name of its parity preset: conf/optim/slamb_v2_official.yaml holds the official
# Slamb_V2's switches (the values live in the YAML, as for every entry; the registry adds no defaults).
register_optimizer(OptimSpec(
    "slamb_v2_official", SLAMB, "self", check=check_slamb_options,
    description="SLAMB with the switches of the official Slamb_V2 (decay outside the trust-ratio norms), "
                "for comparisons with the published code",
))
