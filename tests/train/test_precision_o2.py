"""O2 precision (`precision=bf16_o2` / `fp16_o2`): half weights and activations, fp32 masters stepped by every
optimizer as a reference fed the same upcast gradients, exact resume, fp16 overflow skips, fp32 checkpoints and
exports, and a half-precision DDP all-reduce."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.config import REPO, TINY, compose, optim_preset
from helpers.distributed_harness import run_on_ranks
from helpers.models import tiny_bert_encoder
from safetensors.torch import load_file

from core.errors import ConfigError
from models import create_model
from optim import build_optimizer, get_optimizer_spec
from optim.apex import runnable_optimizers
from optim.comm import Comm
from train.config import validate
from train.half_weights import HalfCopy
from train.metrics import read_metrics
from train.plan import plan_run
from train.run import run
from train.trainer import Trainer


def _train(tmp_path: Path, *overrides: str) -> list[dict]:
    run(compose([*TINY, "precision=bf16_o2", *overrides]), tmp_path)
    return read_metrics(tmp_path)


def _series(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["mlm_loss"], r["nsp_loss"], r["grad_norm"]) for r in records]


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    return model(input_ids=ids).last_hidden_state.float().square().mean()


def test_the_half_copy_is_one_flat_buffer_with_the_masters_structure():
    masters = tiny_bert_encoder()
    half = HalfCopy(masters, torch.bfloat16)
    storage = {p.untyped_storage().data_ptr() for p in half.module.parameters()}
    assert len(storage) == 1  # one flat buffer: each conversion is one foreach copy, whatever the tensor count
    for master, weight in zip(masters.parameters(), half.module.parameters(), strict=True):
        assert weight.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(weight, master.detach().to(torch.bfloat16))
    assert all(b.dtype != torch.float32 for b in half.module.buffers())  # integer ids stay integer


@pytest.mark.parametrize("name", runnable_optimizers())
def test_every_optimizer_steps_the_masters_as_a_reference_fed_the_same_upcast_grads(name):
    """Two steps: the forward and backward in bf16, the optimizer on the fp32 masters; a reference fp32 model with
    its own optimizer, given the half gradients upcast, ends bit for bit where the masters do, and the half
    weights are the masters rounded."""
    masters = tiny_bert_encoder()
    reference = copy.deepcopy(masters)
    half = HalfCopy(masters, torch.bfloat16)
    spec, options = get_optimizer_spec(name), optim_preset(name)
    optimizer = build_optimizer(masters, name, options, comm=Comm())
    expected = build_optimizer(reference, name, options, comm=Comm())
    for _ in range(2):
        for opt in (optimizer, expected):
            opt.zero_grad(set_to_none=True)
            if spec.samples_layers:  # JointSpar switches layers off on the masters; the half copy follows
                opt.begin_step()
        half.follow_trainable()
        _loss(half.module).backward()
        upcast = [None if p.grad is None else p.grad.float() for p in half.params]
        half.grads_to_masters_()
        assert all(p.grad is None for p in half.params)
        for p, grad in zip(reference.parameters(), upcast, strict=True):
            p.grad = grad
        optimizer.step()
        expected.step()
        half.pull_()
    for (key, master), ref, weight in zip(masters.named_parameters(), reference.parameters(), half.params,
                                          strict=True):
        assert torch.equal(master, ref), key
        assert torch.equal(weight, master.detach().to(torch.bfloat16)), key


def test_half_gradients_approximate_the_fp32_ones_and_the_loss_is_fp32():
    masters = tiny_bert_encoder().eval()  # no dropout: the same function in both precisions
    half = HalfCopy(masters, torch.bfloat16)
    loss = _loss(half.module)
    assert loss.dtype == torch.float32
    loss.backward()
    half.grads_to_masters_()
    used = [p for p in masters.parameters() if p.grad is not None]  # the pooler is not
    o2 = torch.cat([p.grad.flatten() for p in used])
    masters.zero_grad(set_to_none=True)
    _loss(masters).backward()
    fp32 = torch.cat([p.grad.flatten() for p in used])
    assert torch.nn.functional.cosine_similarity(o2, fp32, dim=0) > 0.999


def test_floating_inputs_enter_the_half_copy_in_its_dtype():
    conv = torch.nn.Conv2d(3, 4, 3)
    half = HalfCopy(conv, torch.bfloat16)
    assert half.module(torch.randn(1, 3, 8, 8)).dtype == torch.bfloat16  # an fp32 image batch


# In a process of its own: fake tensors left to the interpreter's exit beside safetensors' extension (which the
# export tests load) crashed it at exit.
_COUNT = ("import json; from benchmarks.throughput.conversions import measure; "
          "print(json.dumps({mode: [m.bytes, s.bytes] for mode, (m, s) in measure(128, 2, 'tiny').items()}))")


def test_o2_converts_only_the_logits_in_forward_and_backward():
    """Counted on BERT-tiny's shapes: autocast converts around every matmul, O2 only the MLM and NSP logits into
    fp32 for the loss and their gradients back (read 2 bytes and write 4, then read 4 and write 2, per element)."""
    result = subprocess.run([sys.executable, "-c", _COUNT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.splitlines()[-1])
    logits = 2 * (20 * 30528 + 2)  # micro-batch x (masked positions x padded vocabulary + NSP's two)
    assert counts["O2"][0] == 2 * logits * (2 + 4)
    assert counts["autocast"][0] > 4 * counts["O2"][0]  # both convert the logits, most of it at these shapes
    parameters = sum(p.numel() for p in create_model("bert_pretraining", size="tiny").parameters())
    assert counts["O2"][1] == 2 * parameters * (2 + 4)  # gradients into the masters, masters into the half weights


def test_a_split_run_resumes_bit_for_bit_with_fp32_checkpoints_and_exports(tmp_path):
    reference = _train(tmp_path / "ref", "trainer.ema_decay=0.5")
    _train(tmp_path / "split", "trainer.ema_decay=0.5", "trainer.steps_this_run=3")
    resumed = _train(tmp_path / "split", "trainer.ema_decay=0.5")
    assert _series(resumed) == _series(reference) and len(reference) == 6  # dropout on: the streams resume too
    shared = torch.load(tmp_path / "ref" / "checkpoints" / "step_00000006" / "shared.pt", weights_only=False)
    assert {t.dtype for t in shared["model"].values() if t.is_floating_point()} == {torch.float32}
    for export in ("hf_model", "hf_model_ema"):
        weights = load_file(tmp_path / "ref" / export / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.float32}, export


def test_an_autocast_checkpoint_resumes_under_o2(tmp_path):
    """The checkpoint holds fp32 weights either way: an autocast run goes on under O2 from its own weights."""
    run(compose([*TINY, "precision=bf16", "trainer.steps_this_run=3"]), tmp_path)
    saved = torch.load(tmp_path / "checkpoints" / "step_00000003" / "shared.pt", weights_only=False)["model"]
    cfg = compose([*TINY, "precision=bf16_o2"])
    trainer = Trainer(plan_run(cfg, tmp_path), Comm())
    try:
        assert trainer.step == 3
        for (key, master), weight in zip(trainer.model.named_parameters(), trainer.half.params, strict=True):
            assert torch.equal(master, saved[key]) and torch.equal(weight, saved[key].to(torch.bfloat16)), key
        trainer.fit()
    finally:
        trainer.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]


def test_fp16_overflow_skips_the_step_and_leaves_masters_and_half_weights(tmp_path):
    cfg = compose([*TINY, "precision=fp16_o2", "precision.init_scale=1099511627776.0",  # 2^40: fp16 overflows
                   "precision.max_consecutive_skips=40"])
    trainer = Trainer(plan_run(cfg, tmp_path), Comm())
    try:
        masters = [p.detach().clone() for p in trainer.model.parameters()]
        assert trainer.train_step()["skipped"]
        assert all(torch.equal(a, b) for a, b in zip(masters, trainer.model.parameters(), strict=True))
        assert all(torch.equal(w, m.to(torch.float16)) for w, m in zip(trainer.half.params, masters, strict=True))
        assert trainer.scaler.get_scale() == 2.0**39
        trainer.scaler.update(new_scale=1.0)
        assert not trainer.train_step()["skipped"]
        assert not all(torch.equal(a, b) for a, b in zip(masters, trainer.model.parameters(), strict=True))
        for weight, master in zip(trainer.half.params, trainer.model.parameters(), strict=True):
            assert torch.equal(weight, master.detach().to(torch.float16))
    finally:
        trainer.close()


def test_jointspar_samples_layers_on_the_half_copy(tmp_path):
    records = _train(tmp_path, "optim=jointspar", "trainer.max_steps=3", "trainer.checkpoint_every=0")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)


def test_half_weights_need_a_half_dtype():
    with pytest.raises(ConfigError, match=r"^precision\.weights=half needs a half dtype, not precision\.dtype=fp32: "
                                          r"use precision=bf16_o2 or precision=fp16_o2$"):
        validate(compose([*TINY, "precision.weights=half"]))


def _o2_on_rank(rank: int, world_size: int, tmp_path: Path) -> list[float]:
    """Three O2 steps of LAMB on this rank; its masters, rounded to the half copy, must be the half weights."""
    cfg = compose([*TINY, "precision=bf16_o2", f"trainer.nproc_per_node={world_size}", "trainer.micro_batch_size=2",
                   "trainer.max_steps=3", "trainer.checkpoint_every=0"])
    trainer = Trainer(plan_run(cfg, tmp_path), Comm())
    trainer.fit()
    trainer.close()
    for weight, master in zip(trainer.half.params, trainer.model.parameters(), strict=True):
        assert torch.equal(weight, master.detach().to(torch.bfloat16))
    return [float(p.double().sum()) for p in trainer.model.parameters()]


@pytest.mark.slow
def test_two_ranks_all_reduce_half_gradients_in_half_the_bytes_and_keep_their_masters_alike(tmp_path):
    # global 8 = micro 2 x 2 ranks x 2 accumulation steps; under autocast LAMB sends 32 bits per parameter. The
    # ranks build their models from different seeds: the masters agree only if rank 0's were broadcast.
    ranks = run_on_ranks(_o2_on_rank, 2, tmp_path)
    assert ranks[0] == ranks[1]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["comm_bits_per_param"] == pytest.approx(16.0) for r in records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("options", [["precision=bf16_o2"], ["precision=fp16_o2"],
                                     ["precision=bf16_o2", "trainer.compile=true"],
                                     ["precision=bf16_o2", "trainer.compile=true", "optim=jointspar"]], ids=" ".join)
def test_o2_trains_on_cuda(tmp_path, options):
    on_cuda = [o for o in TINY if not o.startswith("trainer.device=")] + ["trainer.device=cuda"]
    run(compose([*on_cuda, *options, "trainer.max_steps=8", "optim.lr=1e-3"]), tmp_path)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
