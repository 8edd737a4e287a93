"""The `triton` option's three values: true (refused where the kernels cannot run), false, and null, which takes the
kernels on CUDA tensors and the aten ops elsewhere, for every optimizer that has Triton kernels."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.mlp import mlp_steps, small_mlp

from benchmarks.common import COMPRESSED_FROM, config_kwargs, takes_option
from core.errors import ConfigError
from optim import build_optimizer, check_optimizer_config, list_optimizers
from optim.mirror_comm import MirrorComm
from optim.option_checks import use_triton

WITH_KERNELS = [name for name in list_optimizers() if takes_option(name, "triton")]
CUDA = torch.device("cuda")  # a device object needs no GPU


def test_every_optimizer_with_kernels_takes_the_switch():
    assert set(WITH_KERNELS) >= {"lamb", "slamb", "slamb_v2_official", "onebit_adam", "onebit_lamb", "zero_one_adam"}


@pytest.mark.parametrize(("setting", "device", "obstacle", "capability", "expected"), [
    (False, CUDA, None, (9, 0), False),
    (None, CUDA, None, (9, 0), importlib.util.find_spec("triton") is not None),
    (None, CUDA, None, (8, 0), importlib.util.find_spec("triton") is not None),
    (None, CUDA, None, (7, 0), False),  # a V100: the kernels were built and run for newer GPUs only
    (None, CUDA, "takes fp32 parameters", (9, 0), False),
    (None, torch.device("cpu"), None, None, False),  # even under Triton's interpreter (the tests' setting here)
    (None, torch.device("meta"), None, None, False),  # a count of the aten step stays one
])
def test_null_takes_the_kernels_on_cuda_tensors_of_the_gpus_they_were_built_for(monkeypatch, setting, device, obstacle,
                                                                                  capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)  # no GPU needed
    assert use_triton(setting, device, "LAMB", obstacle=obstacle) is expected
    assert use_triton(setting, device, "LAMB", compiled=True, obstacle=obstacle) is False


def test_true_names_the_optimizer_and_why_the_kernels_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match=r"^OneBitLAMB\(triton=True\) takes fp32 parameters; set triton=False$"):
        use_triton(True, CUDA, "OneBitLAMB", obstacle="takes fp32 parameters")
    with pytest.raises(ValueError, match=r"^SLAMB\(triton=True\) and compiled are two ways to fuse the step"):
        use_triton(True, CUDA, "SLAMB", compiled=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"LAMB\(triton=True\) needs CUDA tensors .* not cpu ones"):
        use_triton(True, torch.device("cpu"), "LAMB")


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_null_is_a_valid_setting_and_a_string_is_refused_naming_the_values(name):
    check_optimizer_config(name, {"triton": None})
    with pytest.raises(ConfigError, match=r"optim\.triton=auto must be true or false or null"):
        check_optimizer_config(name, {"triton": "auto"})


@pytest.mark.parametrize("name", WITH_KERNELS)
def test_null_steps_host_tensors_with_the_aten_ops_bit_for_bit(name):
    """Host tensors (here under Triton's interpreter, where `true` would take the kernels): null steps them as
    false does, through the compressed stage of the 1-bit family."""
    models = [small_mlp(12, 16, 3) for _ in range(2)]
    optimizers = [build_optimizer(model, name, config_kwargs(name, triton=triton, **COMPRESSED_FROM.get(name, {})),
                                  comm=MirrorComm(1)) for model, triton in zip(models, (False, None), strict=True)]
    for model, optimizer in zip(models, optimizers, strict=True):
        mlp_steps(model, optimizer, range(4))
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True))
    assert getattr(optimizers[1], "triton", False) is False  # resolved, where the optimizer keeps the switch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", WITH_KERNELS)
def test_null_steps_cuda_tensors_in_the_kernels_bit_for_bit(name):
    """On CUDA tensors null takes the kernels: the same weights as true, bit for bit (no atomic adds)."""
    models = [small_mlp(12, 16, 3).cuda() for _ in range(2)]
    optimizers = [build_optimizer(model, name, config_kwargs(name, triton=triton, **COMPRESSED_FROM.get(name, {})),
                                  comm=MirrorComm(1)) for model, triton in zip(models, (True, None), strict=True)]
    for model, optimizer in zip(models, optimizers, strict=True):
        g = torch.Generator(device="cuda").manual_seed(0)
        for _ in range(4):  # the same gradients for both (no backward, whose kernels may round otherwise)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g, device="cuda") * 1e-2
            optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True))
