"""Whether lists of tensors can be stepped by one multi-tensor kernel that reads each tensor as one block of memory
(the Triton kernels of `optim._triton`, torch's fused and foreach ops): checked on the host before such steps,
so each check is one C++ call per tensor where it can be."""

from __future__ import annotations

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
