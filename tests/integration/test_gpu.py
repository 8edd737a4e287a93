"""On a GPU: mixed-precision training, the fp16 overflow skip, every optimizer's CUDA step against its CPU step, two
processes communicating CUDA tensors, and apex FusedLAMB against our LAMB. Skipped without CUDA (CI has none); run
them with `pytest -m gpu`."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.config import TINY, compose, optim_preset
from helpers.distributed_harness import run_on_ranks
from helpers.models import tiny_bert_encoder

from core.apex import missing_nvidia_apex
from optim import build_optimizer, get_optimizer_spec
from optim.apex import APEX_OPTIMIZERS, runnable_optimizers
from optim.comm import Comm
from train.metrics import read_metrics
from train.run import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ON_CUDA = [o for o in TINY if not o.startswith("trainer.device=")] + ["trainer.device=cuda"]


def _train(tmp_path, *overrides: str) -> list[dict]:
    run(compose([*ON_CUDA, *overrides]), tmp_path)
    return read_metrics(tmp_path)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_mixed_precision_training_on_cuda(tmp_path, precision):
    records = _train(tmp_path, f"precision={precision}", "trainer.max_steps=8", "optim.lr=1e-3")
    losses = [r["loss"] for r in records]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    assert ("loss_scale" in records[-1]) == (precision == "fp16")


def test_fp16_overflow_steps_are_skipped_and_the_scale_drops(tmp_path):
    # A start scale of 2^40 overflows fp16 gradients: the scaler skips those steps (no weight change, not counted
    # towards max_steps) and halves the scale until the gradients fit.
    records = _train(tmp_path, "precision=fp16", "precision.init_scale=1099511627776.0",
                     "precision.max_consecutive_skips=40", "trainer.max_steps=4")
    assert [r["step"] for r in records][-1] == 4
    assert records[-1]["skipped_steps"] > 0
    assert records[-1]["loss_scale"] < 2.0**40
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


@pytest.mark.parametrize("packed", [False, True], ids=["phase1", "phase2_packed"])
def test_the_bert_large_recipes_precision_compile_and_packing_train_on_cuda(tmp_path, packed):
    """What the BERT-Large recipes set (fp16 O2 with loss scaling, torch.compile, phase 2 packed) on a tiny BERT."""
    recipe = compose(["experiment=bert_large_phase2", "data.path=/unused"])
    assert (recipe.precision.dtype, recipe.precision.weights, recipe.trainer.compile) == ("fp16", "half", True)
    assert recipe.data.pack_sequences == 3
    records = _train(tmp_path, "precision=fp16_o2", "trainer.compile=true", "data.max_seq_len=128",
                     f"data.pack_sequences={recipe.data.pack_sequences if packed else 1}", "optim.lr=1e-3")
    assert len(records) == 6 and all(torch.isfinite(torch.tensor([r["loss"] for r in records])))
    assert "loss_scale" in records[-1]
    assert ("sequences_per_row" in records[-1]) == packed


CUDA_OPTIMIZERS = [name for name in runnable_optimizers() if name not in APEX_OPTIMIZERS]  # apex has no CPU step


@pytest.mark.parametrize("name", CUDA_OPTIMIZERS)
def test_each_optimizer_steps_on_cuda_as_on_the_cpu(name):
    """The same gradients, three steps: the CUDA parameters equal the CPU ones to float tolerance."""
    cfg = optim_preset(name)
    spec = get_optimizer_spec(name)
    cpu_model = tiny_bert_encoder()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    cpu_opt, cuda_opt = build_optimizer(cpu_model, name, cfg), build_optimizer(cuda_model, name, cfg)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for optimizer in (cpu_opt, cuda_opt):
            optimizer.zero_grad(set_to_none=True)
            if spec.samples_layers:  # JointSpar draws the step's layers from a CPU generator: the same on both
                optimizer.begin_step()
        cpu_model(input_ids=ids).last_hidden_state.square().mean().backward()
        for p_cpu, p_cuda in zip(cpu_model.parameters(), cuda_model.parameters(), strict=True):
            p_cuda.grad = None if p_cpu.grad is None else p_cpu.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
    for (key, p_cpu), p_cuda in zip(cpu_model.named_parameters(), cuda_model.parameters(), strict=True):
        torch.testing.assert_close(p_cuda.cpu(), p_cpu, rtol=1e-4, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


SELF_SYNCING = {"slamb": {}, "onebit_lamb": {"freeze_step": 2}, "zero_one_adam": {"var_freeze_step": 2}}


def _steps_on_rank(rank: int, world_size: int, name: str, device: str) -> tuple[list[torch.Tensor], int]:
    """Four steps of a self-synchronising optimizer on this rank's own gradients; its weights and bytes sent.

    The gradients are drawn, not computed: on two devices computed ones differ by rounding, and the attention's key
    bias, whose exact gradient is zero, takes full-size steps in whatever direction the rounding gives. On CPU,
    computed gradients perturbed by 1e-7 moved it by 87-130 % of its norm in four steps (and other tensors of 0/1
    Adam by 1 %); drawn ones perturbed by 1e-6 moved no tensor by more than 5e-6.
    """
    cfg = optim_preset(name) | SELF_SYNCING[name]
    model = tiny_bert_encoder().to(device)
    comm = Comm()
    optimizer = build_optimizer(model, name, cfg, comm=comm)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * rank + step)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(device)
        optimizer.step()
    return [p.detach().cpu() for p in model.parameters()], comm.bytes_sent


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SELF_SYNCING))
def test_two_processes_step_cuda_tensors_as_cpu_ones(name):
    """Two ranks exchange CUDA tensors (NCCL on two GPUs; gloo where there is one: NCCL refuses two ranks on one
    GPU) and end with the weights and byte counts of the same run on CPU tensors over gloo."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    on_cpu = run_on_ranks(_steps_on_rank, 2, name, "cpu")
    on_cuda = run_on_ranks(_steps_on_rank, 2, name, "cuda", backend=backend)
    for rank, ((cpu_weights, cpu_bytes), (cuda_weights, cuda_bytes)) in enumerate(zip(on_cpu, on_cuda, strict=True)):
        assert cuda_bytes == cpu_bytes > 0, f"rank {rank}"
        # Loose: sign compression turns a rounding difference of a near-zero momentum into a flipped sign.
        for a, b in zip(cuda_weights, cpu_weights, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))
    if name != "slamb":  # the 1-bit family keeps the replicas identical; SLAMB's differ between dense syncs
        for a, b in zip(on_cuda[0][0], on_cuda[1][0], strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(missing_nvidia_apex("apex.optimizers", "amp_C") is not None, reason="needs NVIDIA apex")
def test_apex_fused_lamb_and_our_lamb_follow_the_same_trajectory():
    """100 steps with the same gradients: apex FusedLAMB (max_grad_norm 1.0, inside the optimizer) and
    `optim.LAMB` (the same global-norm pre-normalisation) stay within float tolerance of each other."""
    lamb_cfg, apex_cfg = optim_preset("lamb"), optim_preset("apex_lamb")
    lamb_cfg["max_grad_norm"] = apex_cfg["max_grad_norm"]
    ours_model = tiny_bert_encoder().cuda()
    apex_model = copy.deepcopy(ours_model)
    ours, fused = build_optimizer(ours_model, "lamb", lamb_cfg), build_optimizer(apex_model, "apex_lamb", apex_cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(100):
        for p_ours, p_apex in zip(ours_model.parameters(), apex_model.parameters(), strict=True):
            p_ours.grad = torch.randn(p_ours.shape, device="cuda", generator=g) * 1e-2
            p_apex.grad = p_ours.grad.clone()
        ours.step()
        fused.step()
    for p_ours, p_apex in zip(ours_model.parameters(), apex_model.parameters(), strict=True):
        torch.testing.assert_close(p_apex, p_ours, rtol=1e-4, atol=1e-5)
