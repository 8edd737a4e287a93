"""Multi-tensor Triton kernels: every tensor of a list reached through a table of addresses, one program per block.

torch's multi-tensor kernels take a list in one launch only when nothing per tensor but its size differs: a factor
per tensor on the device (a trust ratio), or a norm reduced into an elementwise pass, needs a kernel per tensor or a
pass more. These kernels read each tensor's address from a table, as apex's `multi_tensor_apply` does, and cut every
tensor into blocks of `BLOCK` elements, one program each: one launch for a whole chunk of tensors.

This module holds the tables and the passes LAMB and SLAMB share: the Adam moments with the update's direction and
each block's sums of squares (`moments_and_block_sums`), and those sums reduced per tensor, in a fixed order (no
atomic adds: replicas that step the same inputs stay bit-identical, and a resumed run repeats its steps), into norms
(`block_norms`) or LAMB's factors `-lr * ratio` (`trust_factors`). Each is a torch custom op, so a dispatch mode counts
its tensors (`benchmarks.optim.step_cost`) and meta tensors pass through it without a kernel.

The kernels take CUDA tensors, or host tensors under Triton's interpreter (`TRITON_INTERPRET=1`, which Triton reads
when it is imported: slow, for tests). This module imports triton: the optimizers import it only for a step that takes
this path, after `optim.option_checks.triton_refusal` allowed it.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from optim.flat import FixedAddresses

BLOCK = 2048  # elements per program of the elementwise kernels
SUM_BLOCK = 1024  # block sums a program of the reduction adds per iteration
_ADDRESS_TABLES = 64  # address tables kept per process (one per chunk and kind, more when gradients move)
DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ------------------------------------------------------------------------------------------ tables
@functools.cache
def blocks(numels: tuple[int, ...], block: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per block of `block` elements its tensor (int32) and first element (int64); per tensor its size (int64) and,
    as a prefix, its first block (int32, one entry more). Sizes never change: each chunk builds these once."""
    counts = torch.tensor([-(-n // block) for n in numels], dtype=torch.int64)
    first_block = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    total = int(first_block[-1])
    tensor_of_block = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts, output_size=total)
    first_element = (torch.arange(total, dtype=torch.int64) - first_block[:-1].repeat_interleave(counts)) * block
    host = (tensor_of_block, first_element, torch.tensor(numels, dtype=torch.int64), first_block.int())
    return tuple(on_device(t, device) for t in host)  # type: ignore[return-value]


_addresses: dict[tuple, tuple[Tensor, bool]] = {}


def address_table(device: torch.device, *lists: Sequence[Tensor]) -> tuple[Tensor, bool]:
    """The lists' addresses, list after list, as one int64 vector on `device`, reused while they stay put (a
    gradient may move, when the trainer frees it between steps; a parameter should not, but nothing stops a caller);
    and whether every address is a multiple of 16 bytes. A `FixedAddresses` list gives the addresses it read once."""
    key = (device, *itertools.chain.from_iterable(  # map: 0.75x a comprehension's time
        tensors.addresses if isinstance(tensors, FixedAddresses) else map(Tensor.data_ptr, tensors)
        for tensors in lists))
    entry = _addresses.get(key)
    if entry is None:
        if len(_addresses) >= _ADDRESS_TABLES:
            _addresses.clear()
        entry = _addresses[key] = (on_device(torch.tensor(key[1:], dtype=torch.int64), device),
                                   all(address % 16 == 0 for address in key[1:]))
    return entry


def words_of_16_bytes(aligned: bool, numels: Sequence[int]) -> bool:
    """Whether a kernel may move 16 bytes per access (its `ALIGNED`): every tensor starts on a 16-byte boundary
    (`address_table`'s flag) and holds a multiple of 16 elements. Otherwise it moves one element per access."""
    return aligned and all(n % 16 == 0 for n in numels)


@dataclass(frozen=True)
class MultiTensorLaunch:
    """One launch of a multi-tensor kernel over the tensors of a list, a program per block of `BLOCK` elements."""

    programs: int
    head: tuple  # what every such kernel takes first: the address table, the tensor count, the block table
    first_block: Tensor  # per tensor its first block, one entry more (for a reduction of per-block sums)
    aligned: bool  # the kernel's `ALIGNED` (`words_of_16_bytes`)


def multi_tensor_launch(*lists: Sequence[Tensor]) -> MultiTensorLaunch:
    """The tables of a launch over the tensors of `lists[0]` that reaches every tensor of `lists` (list after list)."""
    device, sizes = lists[0][0].device, tuple(map(Tensor.numel, lists[0]))
    tensor_of_block, first_element, numels, first_block = blocks(sizes, BLOCK, device)
    addresses, aligned = address_table(device, *lists)
    return MultiTensorLaunch(tensor_of_block.numel(), (addresses, len(sizes), tensor_of_block, first_element, numels),
                             first_block, words_of_16_bytes(aligned, sizes))


def on_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor copied to `device` without waiting for it (through pinned memory on a GPU)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ------------------------------------------------------------------------------------------ ops
class KernelOp:
    """A kernel's launcher as a torch custom op, called straight where nothing needs the op.

    The op lets a dispatch mode count the kernel's tensors (`benchmarks.optim.step_cost`), lets torch.compile trace
    it, and runs meta tensors through its fake. Its Python wrapper also bumps the version counter of every tensor it
    mutates, one call per tensor: about 0.7 us each, 135 us for a launch that mutates three lists of 60 tensors,
    where the kernel's launch takes a few. So with no dispatch mode, no compiling and no grad mode (an optimizer's
    step), a call runs the launcher (or, on meta tensors, the fake) itself and bumps the mutated tensors' versions
    in one call.
    """

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...]) -> None:
        self.op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        self.fn, self.fake = fn, None
        names = list(inspect.signature(fn).parameters)
        self.mutated = tuple(names.index(argument) for argument in mutates_args)
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: Callable) -> Callable:
        self.op.register_fake(fake)
        self.fake = fake
        return fake

    def __call__(self, *args: Any) -> Any:
        first = next((t for a in args for t in (a if isinstance(a, list | tuple) else (a,))
                      if isinstance(t, Tensor)), None)
        if (first is None or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or _get_current_dispatch_mode() is not None):
            return self.op(*args)
        out = (self.fake if first.is_meta else self.fn)(*args)
        mutated = [t for i in self.mutated for t in (args[i] if isinstance(args[i], list | tuple) else (args[i],))]
        if mutated:
            torch._C._increment_version(mutated)
        return out


def kernel_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable], KernelOp]:
    """Decorate a launcher as `KernelOp` `name` (positional arguments only)."""
    return lambda fn: KernelOp(name, fn, mutates_args)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def block_of(tensor_of_block, first_element, numels, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """This program's tensor, its block's elements and which of them lie inside the tensor (the last block's tail
    does not). `ALIGNED` (`words_of_16_bytes`): blocks start at multiples of `BLOCK` and tensors hold multiples of 16
    elements, so that the compiler may move 16 bytes per access."""
    block = tl.program_id(0)
    tensor = tl.load(tensor_of_block + block)
    offsets = tl.load(first_element + block) + tl.arange(0, BLOCK)
    size = tl.load(numels + tensor)
    if ALIGNED:
        offsets = tl.max_contiguous(tl.multiple_of(offsets, BLOCK), BLOCK)
        size = tl.multiple_of(size, 16)
    return tensor, offsets, offsets < size


@triton.jit
def load_block(addresses, index, offsets, inside, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The tensor at `addresses[index]` (of `DTYPE`; at a multiple of 16 bytes when `ALIGNED`): its pointer and its
    block's elements in fp32 (0 outside it)."""
    at = tl.load(addresses + index).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        at = tl.multiple_of(at, 16)
    return at, tl.load(at + offsets, mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _moments_and_sums(addresses, count, tensor_of_block, first_element, numels, partials, total_blocks, divisor,
                      beta1, beta2, scale, root_correction2, eps, weight_decay, HAS_DIVISOR: tl.constexpr,
                      STORE_DIRECTION: tl.constexpr, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
                      S_DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    tensor, offsets, inside = block_of(tensor_of_block, first_element, numels, BLOCK, ALIGNED)
    _, w = load_block(addresses, tensor, offsets, inside, W_DTYPE, ALIGNED)
    _, g = load_block(addresses, count + tensor, offsets, inside, G_DTYPE, ALIGNED)
    m_at, m = load_block(addresses, 2 * count + tensor, offsets, inside, S_DTYPE, ALIGNED)
    v_at, v = load_block(addresses, 3 * count + tensor, offsets, inside, S_DTYPE, ALIGNED)
    if HAS_DIVISOR:
        g = g / tl.load(divisor)
    m = m + (1.0 - beta1) * (g - m)  # a lerp, as `optim._math.adam_moments_`
    v = v * beta2 + (1.0 - beta2) * g * g
    tl.store(m_at + offsets, m.to(S_DTYPE), mask=inside)
    tl.store(v_at + offsets, v.to(S_DTYPE), mask=inside)
    u = (m * scale) / (tl.sqrt(v) / root_correction2 + eps) + weight_decay * w  # 0 outside the tensor
    if STORE_DIRECTION:
        u_at = tl.load(addresses + 4 * count + tensor).to(tl.pointer_type(tl.float32))
        if ALIGNED:
            u_at = tl.multiple_of(u_at, 16)
        tl.store(u_at + offsets, u, mask=inside)
    block = tl.program_id(0)
    tl.store(partials + block, tl.sum(w * w, axis=0))
    tl.store(partials + total_blocks + block, tl.sum(u * u, axis=0))


@triton.jit
def _reduce_sums(partials, total_blocks, first_block, out, count, lr, max_ratio, FACTORS: tl.constexpr,
                 HAS_MAX: tl.constexpr, SUM_BLOCK: tl.constexpr):
    tensor = tl.program_id(0)
    first = tl.load(first_block + tensor)
    last = tl.load(first_block + tensor + 1)
    w_sum = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    u_sum = tl.zeros([SUM_BLOCK], dtype=tl.float32)
    for start in range(first, last, SUM_BLOCK):
        at = start + tl.arange(0, SUM_BLOCK)
        w_sum += tl.load(partials + at, mask=at < last, other=0.0)
        u_sum += tl.load(partials + total_blocks + at, mask=at < last, other=0.0)
    w_norm = tl.sqrt(tl.sum(w_sum, axis=0))
    u_norm = tl.sqrt(tl.sum(u_sum, axis=0))
    if FACTORS:  # -lr * `optim._math.trust_ratio`
        adapted = (w_norm > 0) & (u_norm > 0)
        ratio = tl.where(adapted, w_norm / tl.where(adapted, u_norm, 1.0), 1.0)
        if HAS_MAX:
            ratio = tl.minimum(ratio, max_ratio)
        tl.store(out + tensor, -lr * ratio)
    else:
        tl.store(out + tensor, w_norm)
        tl.store(out + count + tensor, u_norm)


# ------------------------------------------------------------------------------------------ ops
@kernel_op("slamb_optim::moments_and_block_sums", mutates_args=("exp_avgs", "exp_avg_sqs", "directions"))
def moments_and_block_sums(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor],
                           exp_avg_sqs: list[Tensor], directions: list[Tensor], divisor: Tensor | None, beta1: float,
                           beta2: float, scale: float, bias_correction2: float, eps: float,
                           weight_decay: float) -> Tensor:
    """m and v moved by the gradients (divided by `divisor` when given), the direction
    `u = scale m / (sqrt(v / bias_correction2) + eps) + weight_decay w` (written to `directions`, fp32, unless that
    list is empty), and per block of `BLOCK` elements the sums of w^2 and u^2: a (2, blocks) float32 tensor."""
    launch = multi_tensor_launch(params, grads, exp_avgs, exp_avg_sqs, directions)
    partials = torch.empty((2, launch.programs), dtype=torch.float32, device=params[0].device)
    if launch.programs:
        _moments_and_sums[(launch.programs,)](
            *launch.head, partials, launch.programs, divisor if divisor is not None else partials,
            beta1, beta2, scale, bias_correction2 ** 0.5, eps, weight_decay, HAS_DIVISOR=divisor is not None,
            STORE_DIRECTION=bool(directions), W_DTYPE=DTYPES[params[0].dtype], G_DTYPE=DTYPES[grads[0].dtype],
            S_DTYPE=DTYPES[exp_avgs[0].dtype], BLOCK=BLOCK, ALIGNED=launch.aligned)
    return partials


@moments_and_block_sums.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, directions, divisor, beta1, beta2, scale, bias_correction2, eps,
      weight_decay):
    return params[0].new_empty((2, sum(-(-p.numel() // BLOCK) for p in params)), dtype=torch.float32)


def _reduce(partials: Tensor, numels: list[int], out: Tensor, lr: float, max_ratio: float | None,
            factors: bool) -> Tensor:
    if numels:
        _reduce_sums[(len(numels),)](
            partials, partials.size(1), blocks(tuple(numels), BLOCK, partials.device)[3], out, len(numels), lr,
            max_ratio if max_ratio is not None else 0.0, FACTORS=factors, HAS_MAX=max_ratio is not None,
            SUM_BLOCK=SUM_BLOCK)
    return out


@kernel_op("slamb_optim::block_norms", mutates_args=())
def block_norms(partials: Tensor, numels: list[int]) -> Tensor:
    """Per tensor of `numels` the norms of w and u from `moments_and_block_sums`' block sums: a (2, tensors) tensor."""
    return _reduce(partials, numels, partials.new_empty((2, len(numels))), 0.0, None, factors=False)


@block_norms.register_fake
def _(partials, numels):
    return partials.new_empty((2, len(numels)))


@kernel_op("slamb_optim::trust_factors", mutates_args=())
def trust_factors(partials: Tensor, numels: list[int], lr: float, max_ratio: float | None) -> Tensor:
    """Per tensor `-lr * ratio`, LAMB's ratio `||w|| / ||u||` from the block sums (1 where a norm is 0, at most
    `max_ratio` when given)."""
    return _reduce(partials, numels, partials.new_empty(len(numels)), lr, max_ratio, factors=True)


@trust_factors.register_fake
def _(partials, numels, lr, max_ratio):
    return partials.new_empty(len(numels))
