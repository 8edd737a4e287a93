"""The engine the optimizers that communicate by themselves share: flat state and the passes over it.

- `FlatLayout` (`_layout`): where each parameter's per-element state sits in one flat vector (slots, in
  parameter order), cut into buckets (sent or stepped as one vector, padded; `runs` cuts tensors into buckets of
  whole tensors), segments (one param group each: one op per segment, not per tensor) and chunks (bounded runs,
  their tensors cut into pieces); `rows` lays out per-row state beside it. Built once.
- `FlatState` (`_state`): named buffers over a layout on one device, each parameter's view in the optimizer's
  `state` (so `state_dict()` saves views, no copy), loaded in place chunk by chunk (`load_`, with
  `pop_flat_entries` to keep torch's loader from copying them first), and their bytes (`nbytes`).
- `dense` and `same_layout` (`_tensor_lists`): whether lists of tensors can be stepped by one multi-tensor kernel
  (the DDP optimizers' Triton steps check their groups with them); `FixedAddresses`, a list of views into flat
  state whose addresses the kernels' tables read once.
- Collectives go through `optim.comm.Comm`; the one replica average is `optim.comm.average_tensors_`.

An optimizer places its slots (`FlatLayout.packed`, or its own placement), adds its buffers, and writes its step
as ops over segments, chunks and per-tensor lists of views.
"""

from optim.flat._layout import Bucket, Chunk, FlatLayout, Piece, Slot, foreach_chunks, runs
from optim.flat._state import FlatState, copy_in_chunks_, pop_flat_entries
from optim.flat._tensor_lists import FixedAddresses, dense, same_layout

__all__ = ["Bucket", "Chunk", "FixedAddresses", "FlatLayout", "FlatState", "Piece", "Slot", "copy_in_chunks_", "dense",
           "foreach_chunks", "pop_flat_entries", "runs", "same_layout"]
