"""Named flat buffers over one layout on one device: each parameter's state is a view, saved as it is and loaded
in place."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from optim._math import FOREACH_CHUNK_NUMEL
from optim.flat._layout import Chunk, FlatLayout


class FlatState:
    """Flat buffers of one `FlatLayout` on one device, one per name (`exp_avg`, ...), each in its own dtype.

    A buffer added with the optimizer's `state` puts every parameter's view of it there under its name, so the
    optimizer's `state_dict()` holds the views (torch saves each storage once: no copy is made to save) and its
    per-tensor state reads as usual. Per-slot, per-segment and per-chunk views are built once, so a step makes
    none. `load_` copies saved values into a buffer in place, a chunk at a time: restoring state never holds a
    second copy of it.
    """

    def __init__(self, layout: FlatLayout, device: torch.device, dtype: torch.dtype) -> None:
        self.layout, self.device, self.dtype = layout, device, dtype
        self.buffers: dict[str, Tensor] = {}
        self._fills: dict[str, float] = {}  # each buffer's value where nothing is saved
        self._views: dict[str, list[Tensor]] = {}
        self._segments: dict[str, list[tuple[int, Tensor]]] = {}
        self._pieces: dict[tuple[str, int | None], list[list[Tensor]]] = {}  # per chunk, its pieces' views
        self._chunk_views: dict[tuple[str, int | None], list[Tensor]] = {}  # per chunk, its 1-D view
        self._slot_index: dict[int | None, Tensor] = {}  # per piece, its slot (on the device)

    def add(self, key: str, params: Sequence[Tensor] | None = None, state: Mapping[Tensor, dict] | None = None,
            dtype: torch.dtype | None = None, fill: float = 0.0) -> Tensor:
        """A buffer `key` of `fill` (its fresh value); with `params` (in slot order) and the optimizer's `state`,
        each parameter's view goes into `state[param][key]` (`expose`)."""
        buffer = torch.full((self.layout.numel,), fill, dtype=dtype or self.dtype, device=self.device)
        self.buffers[key], self._fills[key] = buffer, fill
        if params is not None and state is not None:
            self.expose(key, params, state)
        return buffer

    def expose(self, key: str, params: Sequence[Tensor], state: Mapping[Tensor, dict]) -> None:
        """Each parameter's view of buffer `key` into `state[param][key]` (again after torch's loader replaced
        the optimizer's `state`)."""
        for p, view in zip(params, self.views(key), strict=True):
            state[p][key] = view

    def __getitem__(self, key: str) -> Tensor:
        return self.buffers[key]

    def __contains__(self, key: str) -> bool:
        return key in self.buffers

    def views(self, key: str) -> list[Tensor]:
        """Per slot (parameter order), its view of buffer `key`, shaped like the parameter."""
        if key not in self._views:
            self._views[key] = self.layout.views(self.buffers[key])
        return self._views[key]

    def segments(self, key: str) -> list[tuple[int, Tensor]]:
        """(param group, 1-D view) per segment of buffer `key`: one op per segment for per-group math."""
        if key not in self._segments:
            self._segments[key] = self.layout.segment_views(self.buffers[key])
        return self._segments[key]

    def pieces(self, key: str, limit: int | None) -> list[list[Tensor]]:
        """Per chunk of `layout.chunks(limit)`, its pieces' views of buffer `key` (shaped like the parameter when
        whole, 1-D when cut), to run foreach ops beside the same pieces of per-tensor lists (`Piece.of`)."""
        if (key, limit) not in self._pieces:
            views = self.views(key)
            self._pieces[(key, limit)] = [[piece.of(views[piece.slot]) for piece in chunk.pieces]
                                          for chunk in self.layout.chunks(limit)]
        return self._pieces[(key, limit)]

    def chunk_views(self, key: str, limit: int | None) -> list[Tensor]:
        """Per chunk of `layout.chunks(limit)`, its 1-D view of buffer `key`: one op per chunk for flat math."""
        if (key, limit) not in self._chunk_views:
            buffer = self.buffers[key]
            self._chunk_views[(key, limit)] = [buffer[c.start:c.stop] for c in self.layout.chunks(limit)]
        return self._chunk_views[(key, limit)]

    def chunks(self, limit: int | None) -> list[Chunk]:
        return self.layout.chunks(limit)

    def per_slot(self, values: Sequence[Tensor], limit: int | None, reduce: str) -> Tensor:
        """Per slot, the `reduce` ("sum", "amax", ...: `Tensor.scatter_reduce_`) of its pieces' 0-d `values`, given
        for every piece of `chunks(limit)` in order: a per-tensor max or sum over a pass that ran chunk by chunk."""
        if limit not in self._slot_index:  # filled on the device: a host-to-device copy would wait for it
            runs: list[list[int]] = []  # [slot, pieces] of consecutive pieces of one slot
            for piece in (piece for chunk in self.layout.chunks(limit) for piece in chunk.pieces):
                if runs and runs[-1][0] == piece.slot:
                    runs[-1][1] += 1
                else:
                    runs.append([piece.slot, 1])
            self._slot_index[limit] = torch.cat([torch.full((count,), slot, device=self.device)
                                                       for slot, count in runs])
        stacked = torch.stack(list(values))
        out = torch.zeros(len(self.layout.slots), dtype=stacked.dtype, device=self.device)
        return out.scatter_reduce_(0, self._slot_index[limit], stacked, reduce, include_self=False)

    def load_(self, key: str, saved: Sequence[Tensor | None]) -> None:
        """Copy each slot's saved tensor (None: none saved, the buffer's fresh value) into buffer `key`, in place,
        wherever the saved tensors are (a host checkpoint, another dtype): no second copy of the buffer is made."""
        for view, value in zip(self.views(key), saved, strict=True):
            if value is None:
                view.fill_(self._fills[key])
                continue
            if value.shape != view.shape:
                raise ValueError(f"saved '{key}' of shape {tuple(value.shape)} where this parameter's is "
                                 f"{tuple(view.shape)}: not this model's optimizer state")
            copy_in_chunks_(view, value)

    def nbytes(self, keys: Iterable[str] | None = None) -> int:
        """Bytes of the buffers `keys` (default: all)."""
        return sum(self.buffers[k].numel() * self.buffers[k].element_size() for k in (keys or self.buffers))


def copy_in_chunks_(destination: Tensor, source: Tensor) -> None:
    """`destination.copy_(source)` in pieces of the destination device's chunk (`FOREACH_CHUNK_NUMEL`): a copy
    from the host or from another dtype then needs a temporary of one piece at most, not of the whole tensor."""
    limit = FOREACH_CHUNK_NUMEL.get(destination.device.type)
    if limit is None or destination.numel() <= limit or not (destination.is_contiguous() and source.is_contiguous()):
        destination.copy_(source)
        return
    flat_destination, flat_source = destination.view(-1), source.reshape(-1)
    for a in range(0, destination.numel(), limit):
        flat_destination[a:a + limit].copy_(flat_source[a:a + limit])


def pop_flat_entries(state_dict: Mapping[str, Any], keys: Iterable[str]) -> tuple[dict[str, Any], dict[str, list]]:
    """`state_dict` (an optimizer's) without the per-parameter entries `keys`, for torch's loader, which would copy
    them to the device first; and those entries per key, by parameter index (None where absent), for `load_`."""
    keys = set(keys)
    saved = state_dict["state"]
    position = {index: i for i, index in enumerate(i for group in state_dict["param_groups"] for i in group["params"])}
    popped: dict[str, list] = {key: [None] * len(position) for key in keys}
    small: dict[Any, Any] = {}
    for index, entry in saved.items():
        if not isinstance(entry, Mapping):
            small[index] = entry
            continue
        small[index] = {k: v for k, v in entry.items() if k not in keys}
        if index in position:
            for key in keys & entry.keys():
                popped[key][position[index]] = entry[key]
    return {**state_dict, "state": small}, popped
