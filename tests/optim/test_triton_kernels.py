"""The Triton kernels compile for a GPU on a machine without one. Every launch that LAMB, SLAMB and 1-bit steps make
with `triton=True` (run here in Triton's interpreter) is compiled ahead of time with the arguments it was given, for an
A100 (sm_80) and an H100 (sm_90): Triton's code generator and its PTX backend need no device, so what the
interpreter accepts but the compiler would refuse fails here, not on a lent GPU; and a launch whose tensors are
16-byte aligned and sized moves 16 bytes per access. The compiles run in a fresh process, without the interpreter,
which patches Triton's language while it runs."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers.mlp import mlp_steps, small_mlp

from optim import LAMB, SLAMB, OneBitAdam, OneBitLAMB, ZeroOneAdam, param_groups_weight_decay
from optim.adamw import adamw
from optim.mirror_comm import MirrorComm

triton = pytest.importorskip("triton")
from triton.runtime.jit import mangle_type  # noqa: E402

ARCHS = [80, 90]
KERNELS = {"optim._triton": ("_moments_and_sums", "_reduce_sums"), "optim._triton_lamb": ("_apply",),
           "optim.slamb._triton": ("_apply", "_apply_rescaled", "_gather", "_fresh", "_ratios", "_always"),
           "optim._triton_compressed": ("_square_sums", "_rms", "_compress", "_decode"),
           "optim._triton_tensorwise": ("_per_tensor",),
           "optim._triton_onebit_lamb": ("_refresh_and_stats", "_tensor_stats", "_apply"),
           "optim._triton_zero_one_adam": ("_sync_error", "_sync_weights"),
           "optim._triton_adamw": ("_adamw",)}  # the kernels launched
COMPILE = """
import importlib, json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for module, name, signature, constexprs in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(module), name)
    constexprs = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in constexprs.items()}
    for arch in %r:
        source = ASTSource(kernel, signature, constexprs=constexprs)
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
        print(json.dumps([name, arch, ".entry" in ptx, "ld.global.v4" in ptx]))
"""


class _Recording:
    """A kernel whose launches are recorded (function, positional arguments, constexpr keywords), then run."""

    def __init__(self, fn, launcher, launches: list) -> None:
        self.fn, self.launcher, self.launches = fn, launcher, launches

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.launches.append((self.fn, args, constexprs))
            return self.launcher[grid](*args, **constexprs)
        return launch


@pytest.fixture(scope="module")
def launches() -> list:
    """The kernel launches of LAMB's and AdamW's steps (LAMB's pre-normalised, with a clipped ratio; both in fp32 and
    bf16), of SLAMB's (both rescale forms) and of the 1-bit family's compressed steps (1-bit Adam compresses
    `x + error`, 1-bit LAMB its fed-back error, 0/1 Adam's syncs feed q into the error and form the weights again)."""
    recorded: list = []
    with pytest.MonkeyPatch.context() as patch:
        for module, names in KERNELS.items():
            for name in names:
                kernel = getattr(importlib.import_module(module), name)
                patch.setattr(f"{module}.{name}", _Recording(kernel.fn, kernel, recorded))
        for options in (dict(max_grad_norm=0.05), dict(max_grad_norm=None, trust_clip=True)):
            model = small_mlp(8, 16, 4)
            mlp_steps(model, LAMB(param_groups_weight_decay(model, 0.01), lr=1e-2, triton=True, **options), range(2))
        for make in (lambda m: LAMB(param_groups_weight_decay(m, 0.01), lr=1e-2, triton=True),
                     lambda m: adamw(param_groups_weight_decay(m, 0.01), lr=1e-2, triton=True)):
            model = small_mlp(8, 16, 4).to(torch.bfloat16)
            optimizer = make(model)
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
        model = small_mlp(8, 16, 4)
        mlp_steps(model, adamw(param_groups_weight_decay(model, 0.01), lr=1e-2, triton=True), range(2))
        for rescale in ("sum_of_products", "product_of_interpolations"):  # coefficients formed in the update, or read
            model = small_mlp(60, 201, 30)
            mlp_steps(model, SLAMB(param_groups_weight_decay(model, 0.01), lr=1e-2, compress_ratio=0.2, rescale=rescale,
                                   min_compress_numel=1000, comm=MirrorComm(2), triton=True), range(2))
        model = small_mlp(60, 201, 30)  # no decay, no trust ratio: m and v gathered at S_t without the weights
        mlp_steps(model, SLAMB(model.parameters(), lr=1e-2, weight_decay=0.0, always_adapt=False, compress_ratio=0.2,
                               min_compress_numel=1000, comm=MirrorComm(2), triton=True), range(2))
        for cls in (OneBitAdam, OneBitLAMB):
            model = small_mlp(8, 16, 4)
            mlp_steps(model, cls(param_groups_weight_decay(model, 0.01), lr=1e-2, freeze_step=2, comm=MirrorComm(2),
                                 triton=True), range(4))
        model = small_mlp(8, 16, 4)  # a sync after each local step from step 3
        mlp_steps(model, ZeroOneAdam(param_groups_weight_decay(model, 0.01), lr=1e-2, var_freeze_step=2,
                                     local_step_scaler=1, local_step_clipper=1, comm=MirrorComm(2), triton=True),
                  range(5))
    return recorded


def _launch_key(fn, args, constexprs) -> tuple:
    """What the compiler specialises a launch on: the kernel, its arguments' types, its constexprs."""
    names = list(inspect.signature(fn).parameters)
    signature = {name: mangle_type(value) for name, value in zip(names, args, strict=False)}
    signature |= {name: "constexpr" for name in constexprs}
    values = {k: {"dtype": str(v)} if isinstance(v, triton.language.dtype) else v for k, v in constexprs.items()}
    return fn.__module__, fn.__qualname__, signature, values


def test_every_kernel_was_launched(launches):
    launched = {(fn.__module__, fn.__qualname__) for fn, _, _ in launches}
    assert launched == {(module, name) for module, names in KERNELS.items() for name in names}
    gathers = {(c["WEIGHTS"], c["MOMENTS"]) for fn, _, c in launches if fn.__qualname__ == "_gather"}
    assert gathers == {(1, True), (0, True)}  # SLAMB's row gather with the weights and without them


def test_every_launch_compiles_for_a_gpu(launches):
    distinct = {json.dumps(_launch_key(*launch), sort_keys=True) for launch in launches}
    assert len(distinct) >= 7  # LAMB's with and without the divisor and the clip, in fp32 and bf16; SLAMB's
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE % ARCHS], input=f"[{', '.join(sorted(distinct))}]",
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(compiled) == len(distinct) * len(ARCHS) and all(entry for _, _, entry, _ in compiled), result.stdout
    # Where every tensor of a launch is 16-byte aligned and sized (`ALIGNED`), its accesses are 16 bytes wide.
    aligned = [json.loads(key) for key in sorted(distinct)]
    per_key = zip(*[iter(compiled)] * len(ARCHS), strict=True)  # the archs' lines of one launch follow each other
    for (_, name, _, constexprs), lines in zip(aligned, per_key, strict=True):
        assert all(vectors == constexprs.get("ALIGNED", False) for _, _, _, vectors in lines), (name, constexprs)
    assert any(constexprs.get("ALIGNED") for _, _, _, constexprs in aligned)
