"""Lists of tensors for the multi-tensor kernels (the Triton kernels of `optim._triton`, torch's fused and foreach
ops): whether a list can be stepped by one kernel that reads each tensor as one block of memory, checked on the host
before such steps (one C++ call per tensor where it can be); and a list whose addresses are read once."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch._prims_common import is_non_overlapping_and_dense_or_false


def dense(tensor: Tensor) -> bool:
    """Whether `tensor`'s elements fill one block of memory, as the Triton kernels read them. Contiguity, a C++
    check, decides first: torch 2.11's general check builds a NamedTuple class per call, 15 ms a BERT-Large step on
    an H100's host (3x the step's kernels)."""
    return tensor.is_contiguous() or is_non_overlapping_and_dense_or_false(tensor)


def same_layout(params: list[Tensor], *lists: list[Tensor]) -> bool:
    """One device and dtype, and each tensor of `lists` laid out as the parameter at its place: a multi-tensor
    kernel pairs elements by their place in memory (a channels_last weight with a contiguous gradient would mix
    them)."""
    device, dtype = params[0].device, params[0].dtype
    tensors = [*params, *(t for tensors in lists for t in tensors)]
    if not all(t.dtype == dtype and t.device == device for t in tensors):
        return False
    # Contiguous tensors of one shape share their layout: one C++ call each, where comparing strides builds tuples
    # (together half a millisecond of each BERT-Large step on a host that a GPU waits for).
    return all(t.is_contiguous() for t in tensors) or all(
        t.stride() == p.stride() for tensors in lists for p, t in zip(params, tensors, strict=True))


class FixedAddresses(list):
    """Tensors that stay where they are for as long as the list lives (an optimizer's views into its own flat
    buffers), with their addresses read once; a slice keeps them. The Triton kernels' address tables take these
    instead of asking each tensor each step (`optim._triton.address_table`): SLAMB's lists of its m, v and direction
    views hold about 2,000 tensors a BERT-Large step, at about 0.3 us a tensor on a GPU's host."""

    def __init__(self, tensors: list[Tensor], addresses: tuple[int, ...] | None = None) -> None:
        super().__init__(tensors)
        self.addresses = tuple(map(Tensor.data_ptr, self)) if addresses is None else addresses

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return FixedAddresses(super().__getitem__(index), self.addresses[index])
        return super().__getitem__(index)
