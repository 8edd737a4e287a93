"""DDP's gradient all-reduce through the counting comm layer, in the dtype the gradients travel in."""

# No `from __future__ import annotations`: DDP inspects the hook's annotations as real types.
import torch
import torch.distributed as dist

from optim.comm import WIRE_DTYPES, Comm


class AllReduceHookState:
    """What `counting_allreduce_hook` needs: the comm layer that counts, and the dtype gradients travel in."""

    def __init__(self, comm: Comm, wire_dtype: str = "fp32") -> None:
        self.comm, self.wire_dtype = comm, WIRE_DTYPES[wire_dtype]


def counting_allreduce_hook(
    state: AllReduceHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean all-reduce of default DDP, in the state's wire dtype, with its bytes counted.

    Register with `ddp_model.register_comm_hook(AllReduceHookState(comm, "fp16"), counting_allreduce_hook)`.
    In fp32 it matches DDP with no hook bit for bit (divide by the world size, then sum). In fp16 or bf16 it
    sends half the bytes, like NVIDIA's BERT (`allreduce_post_accumulation_fp16`): the division happens in fp32
    before the cast, so small gradients do not underflow, and the sum is taken in the wire dtype.
    """
    comm = state.comm
    buffer = bucket.buffer().div_(comm.world_size)
    if state.wire_dtype == buffer.dtype:
        return comm.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])
    payload = buffer.to(state.wire_dtype)
    work = comm.all_reduce(payload, async_op=True)
    return work.get_future().then(lambda fut: buffer.copy_(fut.value()[0]))
