"""The one layer that talks to the process group, counting the bytes this rank sends per collective.

Bytes are the payload a rank contributes to a collective (`numel * element_size` of its input), which is
what compression changes; how the backend moves them (ring, tree) is not modelled. Algorithm traffic
(gradients, momenta, parameters) and control traffic (stop and overflow flags) are counted apart, so the
headline metric, bits per parameter per step, holds only the algorithm's own data. Each algorithm collective is
also counted by kind (all_reduce, all_gather, all_to_all, broadcast), which is what a network cost model needs.

A simulated network (`Comm(network=parse_cluster("10gbe"))`, `trainer.simulated_network`) makes every algorithm
collective last at least the time `optim.network` models for its kind, bytes and world size: the rank sleeps out
the rest after the real collective. Collectives share one simulated link, so one issued while another is still
"on the wire" starts when that one ends. Control traffic is not delayed. On a GPU the delay waits for the device
before and after each collective (host syncs): a simulated run measures what a network costs, not peak speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from optim.network import KINDS, Cluster, collective_seconds

# torch 2.14 deprecates all_gather_into_tensor for all_gather_single; the images' older torch builds have only the
# former
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """Collectives over one process group with byte counters.

    With no initialised process group (or a group of one) every collective is the identity and nothing is
    counted: no bytes leave the process. `network`, when given, is the simulated cluster (see the module).
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, network: Cluster | None = None) -> None:
        self.group = process_group
        self.initialized = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(process_group) if self.initialized else 1
        self.rank = dist.get_rank(process_group) if self.initialized else 0
        self.network = network
        self.bytes_sent = 0
        self.control_bytes_sent = 0
        self.collectives = 0
        self.by_kind = {kind: {"collectives": 0, "bytes": 0} for kind in KINDS}
        self.replica_average_bytes = 0  # outside the steps (`counted=False`): tallied apart, see `all_reduce`
        self._link_free_at = 0.0  # perf_counter time when the simulated link has sent everything issued so far
        self._gloo_group: dist.ProcessGroup | None = None  # host-side votes (`any_later`), made when first needed

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _count(self, tensor: torch.Tensor, kind: str = "all_reduce") -> None:
        """Charge this rank `tensor`'s bytes for one collective of `kind`."""
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        self.collectives += 1
        self.by_kind[kind]["collectives"] += 1
        self.by_kind[kind]["bytes"] += nbytes

    def _deadline(self, kind: str, tensor: torch.Tensor) -> float | None:
        """When the simulated link would have delivered this collective (None: no simulated network)."""
        if self.network is None:
            return None
        _device_idle(tensor)  # the collective starts once the device reaches it, not when the host queues it
        nbytes = tensor.numel() * tensor.element_size()
        start = max(time.perf_counter(), self._link_free_at)
        self._link_free_at = start + collective_seconds(kind, nbytes, self.world_size, self.network)
        return self._link_free_at

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
                   counted: bool = True):
        """In-place all-reduce of algorithm data; returns the Work handle when `async_op`.

        `counted=False`: a replica average outside the steps (for an evaluation or an export), tallied apart in
        `replica_average_bytes` (see `take_replica_average_bytes`): not charged to the step, nor delayed by a
        simulated network.
        """
        if not self.distributed:
            return completed(tensor) if async_op else None
        if counted:
            self._count(tensor, "all_reduce")
        else:
            self.replica_average_bytes += tensor.numel() * tensor.element_size()
        deadline = self._deadline("all_reduce", tensor) if counted else None
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        if deadline is None:
            return work
        if work is None:
            _sleep_until(deadline, tensor)
            return None
        return _DelayedWork(work, deadline, tensor)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """In-place broadcast from `src`; only the source rank is charged the bytes."""
        if not self.distributed:
            return
        if self.rank == src:
            self._count(tensor, "broadcast")
        deadline = self._deadline("broadcast", tensor)  # every rank waits for the data, sender or not
        dist.broadcast(tensor, src=src, group=self.group)
        _sleep_until(deadline, tensor)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Gather every rank's `tensor` into `output` (rank-major); a rank is charged its own input."""
        if not self.distributed:
            output.copy_(tensor.reshape(output.shape))
            return
        self._count(tensor, "all_gather")
        deadline = self._deadline("all_gather", tensor)
        _all_gather_single(output, tensor, group=self.group)
        _sleep_until(deadline, output)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """Chunk j of `tensor` (equal split along dim 0) goes to rank j; chunk i of `output` comes from rank i.

        A rank is charged its whole input, as for the other collectives (the 1-bit all-reduce's phase 1).
        """
        if not self.distributed:
            output.copy_(tensor.reshape(output.shape))
            return
        self._count(tensor, "all_to_all")
        deadline = self._deadline("all_to_all", tensor)
        dist.all_to_all_single(output, tensor, group=self.group)
        _sleep_until(deadline, output)

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank (control traffic, e.g. a stop request).

        Reads the result on the host: call it at log intervals, not inside a step (see `any_on_device`).
        """
        if not self.distributed:
            return flag
        return bool(self.any_on_device(torch.tensor(flag, device=self._control_device())).item())

    def any_later(self, flag: bool) -> PendingVote:
        """Start agreeing on whether `flag` is true on any rank; the returned vote's `result()` says.

        The vote travels over a host-side (gloo) group of the same ranks, so neither posting nor reading it
        waits for the device, and posting does not wait for the other ranks either: read it a micro-batch
        later and it has long arrived. Every rank must post the same votes in the same order (control
        traffic, 4 bytes each).
        """
        value = torch.tensor([int(flag)], dtype=torch.int32)
        if not self.distributed:
            return PendingVote(None, value)
        self.control_bytes_sent += value.element_size()
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._host_group(), async_op=True)
        return PendingVote(work, value)

    def any_on_device(self, flag: torch.Tensor) -> torch.Tensor:
        """A 0-d bool tensor, true on every rank if `flag` (a 0-d bool tensor) is true on any rank.

        Nothing is read on the host, so the step does not wait for the device (control traffic, 4 bytes).
        """
        if not self.distributed:
            return flag
        value = flag.to(torch.int32).reshape(1)
        self.control_bytes_sent += value.element_size()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value[0].bool()

    def average_control(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a few reporting values (losses for the log): control traffic."""
        if not self.distributed:
            return tensor
        tensor = tensor.to(self._control_device())
        self.control_bytes_sent += tensor.numel() * tensor.element_size()
        dist.all_reduce(tensor, group=self.group)
        return tensor / self.world_size

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        """Send a small picklable object (a run directory, say) from `src` to all ranks."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's small picklable object (a checkpoint file's checksum, say), in rank order, on all ranks."""
        if not self.distributed:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def take_counts(self, by_kind: bool = False) -> dict:
        """Counters since the previous call, then reset: call once per optimizer step.

        `bytes`, `control_bytes` and `collectives` are totals; with `by_kind`, also `by_kind`: each algorithm
        collective kind (all_reduce, all_gather, all_to_all, broadcast) -> `{"collectives": n, "bytes": b}`, whose
        sums are the totals.
        """
        counts = {"bytes": self.bytes_sent, "control_bytes": self.control_bytes_sent, "collectives": self.collectives}
        if by_kind:
            counts["by_kind"] = self.by_kind
        self.bytes_sent = self.control_bytes_sent = self.collectives = 0
        self.by_kind = {kind: {"collectives": 0, "bytes": 0} for kind in KINDS}
        return counts

    def take_replica_average_bytes(self) -> int:
        """The bytes of the replica averages since the previous call (`counted=False` all-reduces), then reset."""
        taken, self.replica_average_bytes = self.replica_average_bytes, 0
        return taken

    def _host_group(self) -> dist.ProcessGroup:
        """A gloo group over this layer's ranks, made on first use (every rank makes it at the same call)."""
        if self._gloo_group is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            self._gloo_group = dist.new_group(ranks=ranks, backend="gloo")
        return self._gloo_group

    def _control_device(self) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class PendingVote:
    """The answer of `Comm.any_later`: true if any rank voted true."""

    def __init__(self, work: dist.Work | None, value: torch.Tensor) -> None:
        self._work, self._value = work, value

    def result(self) -> bool:
        """Waits for the other ranks' votes (not for any device), then reads the agreed answer."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return bool(self._value[0])


def _device_idle(tensor: torch.Tensor) -> None:
    """Wait for the device's queued work on `tensor`'s device (CUDA); nothing to wait for on the CPU."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def _sleep_until(deadline: float | None, tensor: torch.Tensor) -> None:
    """After a collective on `tensor`: wait for it on the device, then sleep until the simulated `deadline`."""
    if deadline is None:
        return
    _device_idle(tensor)
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class _DelayedWork:
    """An asynchronous collective under a simulated network: complete at the real end or the deadline, whichever
    is later, whether the caller waits on it (`wait`) or chains on its future (a DDP comm hook)."""

    __slots__ = ("_deadline", "_tensor", "_work")

    def __init__(self, work: dist.Work, deadline: float, tensor: torch.Tensor) -> None:
        self._work, self._deadline, self._tensor = work, deadline, tensor

    def wait(self) -> bool:
        self._work.wait()
        _sleep_until(self._deadline, self._tensor)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future().then(self._delayed)

    def _delayed(self, future: torch.futures.Future):
        _sleep_until(self._deadline, self._tensor)
        return future.value()


def completed(tensor: torch.Tensor):
    """A finished Work-like handle (one process, or a mirrored rank), so callers can `.wait()` uniformly."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result([tensor])
    return _DoneWork(future)


class _DoneWork:
    __slots__ = ("_future",)

    def __init__(self, future: torch.futures.Future) -> None:
        self._future = future

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


WIRE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def average_tensors_(tensors: Sequence[torch.Tensor], comm: Comm, bucket_numel: int | None = None,
                     wire_dtype: torch.dtype = torch.float32, counted: bool = True) -> None:
    """Mean over the ranks of `tensors`, in place: the one replica average (the optimizers that synchronise
    themselves, and, with `counted=False`, the evaluation and export of drifted replicas: tallied on their own
    line, see `Comm.all_reduce`).

    The tensors are laid end to end and travel in all-reduces of at most `bucket_numel` elements (None: one), all
    in flight at once. One contiguous fp32 tensor (a flat buffer) is reduced where it lies; other tensors go
    through one fp32 staging vector and are copied home (cast to their dtype). A 16-bit `wire_dtype` sends half
    the bytes: each rank's share is divided by the world size in fp32 before the cast (so small values do not
    underflow) and the sum is taken in the wire dtype, as DeepSpeed's fp16 engine does.
    """
    if not comm.distributed or not tensors:
        return
    in_place = len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].dtype == torch.float32
    flat = tensors[0].detach().view(-1) if in_place else torch.cat([t.detach().reshape(-1).float() for t in tensors])
    payload = flat if wire_dtype == flat.dtype else flat.div_(comm.world_size).to(wire_dtype)
    works = [comm.all_reduce(piece, async_op=True, counted=counted)
             for piece in payload.split(bucket_numel or max(payload.numel(), 1))]
    for work in works:
        work.wait()
    if payload is flat:
        flat.div_(comm.world_size)
    else:
        flat.copy_(payload)
    if not in_place:
        homes = [t.detach() for t in tensors]
        torch._foreach_copy_(homes, [v.view_as(t) for t, v in zip(homes, flat.split([t.numel() for t in homes]),
                                                                     strict=True)])
