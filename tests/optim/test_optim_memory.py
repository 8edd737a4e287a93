"""Optimizer memory at scale: no whole-state copies on resume, foreach temporaries bounded by a chunk.

Measured without a GPU: a dispatch mode sums the bytes of every new storage the code allocates, and
storages are compared by address, so a full-size copy shows up however briefly it lives.
"""

from __future__ import annotations

import io
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from optim import LAMB, LARS, SLAMB, OneBitLAMB, SlowMo
from optim._math import FOREACH_CHUNK_NUMEL
from optim.comm import Comm
from optim.compressed import compressed_allreduce_
from optim.mirror_comm import MirrorComm


class _NewStorageBytes(TorchDispatchMode):
    """Bytes of the storages created by the operations run under it (outputs not sharing an input's storage):
    `bytes` in all, `peak` the most alive at once (a storage counts until the tensor returned with it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs or {}))[0]
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.bytes += nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
                inputs.add(t.untyped_storage().data_ptr())
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))


def _slamb_after_steps(model: nn.Module, steps: int) -> SLAMB:
    optimizer = SLAMB(model.parameters(), lr=1e-2, min_compress_numel=1000, freshness_dtype="fp16")
    for step in range(steps):
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def _checkpoint(optimizer: torch.optim.Optimizer) -> dict:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _state_storages(optimizer: SLAMB, model: nn.Module) -> list[int]:
    return [optimizer.state[p][key].untyped_storage().data_ptr()
            for p in model.parameters() for key in ("exp_avg", "exp_avg_sq", "scaled_freshness")]


def test_slamb_resume_into_a_running_optimizer_allocates_no_second_state():
    """Loading into an optimizer that has its buffers fills them in place: same storages, no new state."""
    model = _model()
    saved = _checkpoint(_slamb_after_steps(model, 3))
    optimizer = _slamb_after_steps(model, 1)
    before = _state_storages(optimizer, model)
    with _NewStorageBytes() as allocated:
        optimizer.load_state_dict(saved)
    assert _state_storages(optimizer, model) == before
    assert allocated.bytes < optimizer.memory_bytes()["state"] // 20
    for index, p in enumerate(model.parameters()):
        assert torch.equal(optimizer.state[p]["exp_avg"], saved["state"][index]["exp_avg"])
        assert torch.equal(optimizer.state[p]["scaled_freshness"], saved["state"][index]["scaled_freshness"])


def test_slamb_resume_into_a_fresh_optimizer_allocates_the_state_once():
    """A fresh optimizer (a resumed run) builds its buffers and copies into them: no per-tensor copies beside."""
    model = _model()
    saved = _checkpoint(_slamb_after_steps(model, 3))
    optimizer = SLAMB(model.parameters(), lr=1e-2, min_compress_numel=1000, freshness_dtype="fp16")
    with _NewStorageBytes() as allocated:
        optimizer.load_state_dict(saved)
    memory = optimizer.memory_bytes()
    assert allocated.bytes <= memory["state"] + memory["scratch"] + 4096
    assert optimizer.state["slamb"]["step"] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_slamb_resume_on_a_gpu_from_a_host_checkpoint_peaks_at_one_state():
    """Torch's loader would copy every state tensor to the GPU beside the flat buffers: twice the state."""
    model = _model()
    saved = _checkpoint(_slamb_after_steps(model, 3))  # on the host, as the trainer loads it
    gpu_model = _model().cuda()
    optimizer = SLAMB(gpu_model.parameters(), lr=1e-2, min_compress_numel=1000, freshness_dtype="fp16")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    optimizer.load_state_dict(saved)
    memory = optimizer.memory_bytes()
    assert torch.cuda.max_memory_allocated() - baseline <= memory["state"] + memory["scratch"] + (1 << 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lamb_step_temporaries_on_a_gpu_are_bounded_by_the_chunk():
    """One group of 2^28 elements: its foreach temporaries come in chunks, not in group-sized tensors."""
    params = [nn.Parameter(torch.randn(1 << 24, device="cuda")) for _ in range(16)]
    optimizer = LAMB([{"params": params, "weight_decay": 0.01}], lr=1e-3, max_grad_norm=1.0)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()  # the state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    optimizer.step()
    chunk_bytes = 4 * FOREACH_CHUNK_NUMEL["cuda"]
    assert torch.cuda.max_memory_allocated() - baseline <= 3 * chunk_bytes < 4 * sum(p.numel() for p in params)


@pytest.mark.parametrize("kind", ["lars", "slowmo"])
def test_whole_group_steps_keep_temporaries_to_one_chunk(kind, monkeypatch):
    """LARS's directions and SlowMo's drift are per-tensor temporaries: with 2 tensors per foreach chunk, at
    most one chunk's (plus small per-tensor norms) is alive at once, not the whole group's 16 tensors."""
    monkeypatch.setitem(FOREACH_CHUNK_NUMEL, "cpu", 2 * 4096)
    params = [nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(i))) for i in range(16)]
    for p in params:
        p.grad = torch.randn_like(p)
    if kind == "lars":
        optimizer = LARS(params, lr=0.1, momentum=0.9, weight_decay=1e-4)
    else:
        optimizer = SlowMo(params, lr=0.1, sync_interval=1, comm=Comm())
    optimizer.step()  # the state exists from here on
    with _NewStorageBytes() as counted:
        optimizer.step()
    chunk_bytes = 4 * FOREACH_CHUNK_NUMEL["cpu"]
    assert counted.bytes >= 4 * 4096  # it did allocate temporaries ...
    assert counted.peak <= chunk_bytes + 1024  # ... one chunk's at a time


def _storage_sizes(obj: object, seen: dict[int, int], visited: set[int]) -> dict[int, int]:
    """data_ptr -> nbytes of every tensor storage reachable from `obj` through containers and our objects."""
    if id(obj) in visited:
        return seen
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _storage_sizes(key, seen, visited)
            _storage_sizes(value, seen, visited)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _storage_sizes(value, seen, visited)
    elif type(obj).__module__.startswith("optim"):
        _storage_sizes(vars(obj), seen, visited)
    return seen


def test_onebit_lamb_keeps_no_twin_of_the_momentum():
    """DeepSpeed clones every momentum at each compression step; here the dead gradients stand in for the clone:
    the only momentum-sized buffers are the per-element state, the cached denominators and the error buffers."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    optimizer = OneBitLAMB(model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3, comm=Comm())
    for _ in range(6):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert optimizer.compressing(optimizer.step_count)
    flat_bytes = 4 * optimizer.flat.layout.numel
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    parameters |= {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = _storage_sizes(optimizer, {}, set())
    momentum_sized = [ptr for ptr, n in sizes.items() if n >= flat_bytes and ptr not in parameters]
    # m, v, v_fresh, sqrt(v) + eps; the worker and (on one rank, as large) server error buffers
    assert sorted(optimizer.flat.buffers) == ["denom", "exp_avg", "exp_avg_sq", "exp_avg_sq_fresh", "zero_variance"]
    assert len(momentum_sized) == 4 + 2


def test_compressed_allreduce_temporaries_are_bounded_by_the_chunk(monkeypatch):
    """The server stage decodes the W received sign vectors a block of columns at a time, and the signs are
    packed a block at a time: no temporary of the buffer's size (a decoded copy is 11.6 GB at BERT-XL)."""
    monkeypatch.setitem(FOREACH_CHUNK_NUMEL, "cpu", 4096)
    numel, world = 1 << 16, 4
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    worker_error, server_error = torch.zeros(numel), torch.zeros(numel // world)
    with _NewStorageBytes() as counted:
        compressed_allreduce_(buffer, worker_error, server_error, MirrorComm(4))
    server = 4 * numel // world  # the server stage's own chunk, fp32
    signs = 3 * (numel // 8 + 64)  # packed signs: sent, received, gathered
    assert counted.peak <= server + signs + 16 * 4096
    assert counted.peak < 4 * numel  # less than one fp32 copy of the buffer


def test_onebit_resume_copies_the_state_into_its_flat_buffers_in_place():
    """Torch's loader would first cast every saved state tensor to the parameters' dtype and device, all of them
    alive at once beside the flat buffers: a second copy of the state. The 1-bit family copies each saved tensor
    into its flat buffers a chunk at a time (here from a float64 checkpoint, as a host checkpoint on a GPU)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    optimizer = OneBitLAMB(model.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3, comm=MirrorComm(2))
    for _ in range(5):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
    saved = _checkpoint(optimizer)
    for entry in saved["state"].values():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.dtype == torch.float32:
                entry[key] = value.double()
    before = {key: buffer.untyped_storage().data_ptr() for key, buffer in optimizer.flat.buffers.items()}
    with _NewStorageBytes() as allocated:
        optimizer.load_state_dict(saved)
    assert {key: buffer.untyped_storage().data_ptr() for key, buffer in optimizer.flat.buffers.items()} == before
    largest = 4 * max(p.numel() for p in model.parameters())
    assert allocated.peak <= largest + 4096  # one tensor's cast at a time, not the state
    for index, p in enumerate(model.parameters()):
        assert optimizer.state[p]["exp_avg"].untyped_storage().data_ptr() == before["exp_avg"]
        assert torch.equal(optimizer.state[p]["exp_avg_sq_fresh"], saved["state"][index]["exp_avg_sq_fresh"].float())
