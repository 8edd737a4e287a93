"""A stand-in for a process group in one process, for tests and benchmarks: every rank mirrors this one."""

from __future__ import annotations

import torch
import torch.distributed as dist

from optim.comm import Comm, PendingVote, completed


class MirrorComm(Comm):
    """`world_size` ranks in one process that all hold this rank's tensors, for tests and benchmarks.

    Every collective returns at once with what identical ranks would receive (a sum all-reduce multiplies by the
    world size, so an average is the identity; an all-gather repeats the input), so an optimizer takes its whole
    multi-rank code path deterministically, with nothing to wait for. Bytes are counted as a real rank's, and
    each algorithm collective is also recorded in `calls` as (kind, bytes this rank put in).
    """

    def __init__(self, world_size: int = 1) -> None:
        super().__init__(None)
        self.world_size = world_size
        self.calls: list[tuple[str, int]] = []

    @property
    def distributed(self) -> bool:
        return True  # even one mirrored rank takes the multi-rank path

    def _count(self, tensor: torch.Tensor, kind: str = "all_reduce") -> None:
        super()._count(tensor, kind)
        self.calls.append((kind, tensor.numel() * tensor.element_size()))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False,
                   counted: bool = True):
        if counted:
            self._count(tensor, "all_reduce")
        if op == dist.ReduceOp.SUM and self.world_size > 1:
            tensor.mul_(self.world_size)
        return completed(tensor) if async_op else None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.rank == src:
            self._count(tensor, "broadcast")

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._count(tensor, "all_gather")
        output.view(self.world_size, -1).copy_(tensor.reshape(1, -1).expand(self.world_size, -1))

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        self._count(tensor, "all_to_all")
        output.copy_(tensor.reshape(output.shape))

    def any(self, flag: bool) -> bool:
        return flag

    def any_later(self, flag: bool) -> PendingVote:
        return PendingVote(None, torch.tensor([int(flag)], dtype=torch.int32))

    def any_on_device(self, flag: torch.Tensor) -> torch.Tensor:
        return flag

    def average_control(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: object, src: int = 0) -> object:
        return obj

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj] * self.world_size

    def barrier(self) -> None:
        pass
