"""Swin from timm: builders, the official recipe as composed, and the trainer on the digits demo."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers.config import compose, swin_digits_overrides
from helpers.runs import run_train

from models import create_model, export_timm_model
from optim.param_groups import param_groups_weight_decay
from optim.schedule import linear_warmup_cosine
from train.config import validate
from train.metrics import read_metrics
from train.run import run

TINY_SWIN = dict(arch="swin_tiny_patch4_window7_224", num_classes=10, img_size=32, patch_size=2, embed_dim=32,
                 depths=[2, 2], num_heads=[2, 4], window_size=4)


def _train(digits: Path, run_dir: Path, *overrides: str) -> list[dict]:
    run(compose(swin_digits_overrides(digits, run_dir, *overrides)), run_dir)
    return read_metrics(run_dir)


def test_tiny_swin_steps_and_options_keep_the_maths():
    torch.manual_seed(0)
    plain = create_model("swin", **TINY_SWIN, drop_path_rate=0.0)
    images = torch.randn(4, 3, 32, 32)
    plain(images).logsumexp(-1).sum().backward()
    for option in ("channels_last", "grad_checkpointing"):
        other = create_model("swin", **TINY_SWIN, drop_path_rate=0.0, **{option: True})
        other.load_state_dict(plain.state_dict())
        out = other(images)
        assert torch.allclose(out, plain(images), atol=1e-5), option
        out.logsumexp(-1).sum().backward()
        for (name, p), q in zip(plain.named_parameters(), other.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, atol=1e-5), (option, name)
    assert create_model("swin", **TINY_SWIN, channels_last=True).patch_embed.proj.weight.is_contiguous(
        memory_format=torch.channels_last)


def test_swin_base_matches_the_paper_and_decay_skips_position_tables():
    model = create_model("swin", drop_path_rate=0.5)  # the builder's default arch is Swin-B
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(87.77e6, rel=1e-3)  # "88M"
    assert model.embed_dim == 128 and [len(stage.blocks) for stage in model.layers] == [2, 2, 18, 2]
    assert model.layers[-1].blocks[-1].drop_path1.drop_prob == pytest.approx(0.5)  # linear to 0.5 at the end
    _, no_decay = param_groups_weight_decay(model, 0.05)
    no_decay_ids = {id(p) for p in no_decay["params"]}
    for name, param in model.named_parameters():
        exempt = param.ndim <= 1 or "relative_position_bias_table" in name
        assert (id(param) in no_decay_ids) == exempt, name
    assert not any("absolute_pos_embed" in name for name, _ in model.named_parameters())  # Swin-B: ape off


def test_export_loads_back_in_timm(tmp_path):
    import timm

    model = create_model("swin", **TINY_SWIN).eval()
    export_timm_model(model, tmp_path / "export")
    loaded = timm.create_model(f"local-dir:{tmp_path / 'export'}", pretrained=True).eval()
    images = torch.randn(2, 3, 32, 32)
    assert torch.equal(loaded(images), model(images))


def test_official_recipe_resolves():
    cfg = compose(["experiment=swin_base_imagenet", "data.path=/datasets/imagenet", "trainer.device=cpu"])
    validate(cfg)
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 1.0e-3  # 5e-4 x 1024 / 512
    assert (cfg.optim.eps, list(cfg.optim.betas), cfg.optim.weight_decay) == (1.0e-8, [0.9, 0.999], 0.05)
    assert (cfg.trainer.epochs, cfg.trainer.global_batch_size, cfg.trainer.grad_clip) == (300, 1024, 5.0)
    assert cfg.schedule.name == "linear_warmup_cosine"
    assert cfg.schedule.kwargs.warmup_fraction * 300 == pytest.approx(20)
    assert cfg.schedule.kwargs.min_ratio * cfg.optim.lr == pytest.approx(1e-5)
    assert (cfg.model.arch, cfg.model.drop_path_rate, cfg.model.num_classes) == ("swin_base_patch4_window7_224", 0.5,
                                                                                 1000)
    assert cfg.data.num_classes == 1000 and cfg.data.crop_pct == 0.875 and cfg.data.interpolation == "bicubic"
    assert (cfg.trainer.best_metric, cfg.trainer.keep_best, cfg.precision.dtype) == ("eval/top1", 3, "fp16")
    # 1,281,167 images / 1024 per step x 300 epochs; warm-up 20 epochs
    total = math.ceil(300 * (1281167 // 1024 * 1024) / 1024)
    assert linear_warmup_cosine(1, total, warmup_fraction=20 / 300) == pytest.approx(1 / 25020)
    assert linear_warmup_cosine(25020, total, warmup_fraction=20 / 300) == 1.0
    assert linear_warmup_cosine(total, total, warmup_fraction=20 / 300, min_ratio=0.01) == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("name", "optim"), [("swin_base_imagenet_lamb", "lamb"), ("swin_base_imagenet_slamb", "slamb")]
)
def test_large_batch_experiments_resolve(name, optim):
    cfg = compose([f"experiment={name}", "data.path=/datasets/imagenet", "trainer.device=cpu"])
    validate(cfg)
    assert cfg.optim.name == optim and cfg.trainer.global_batch_size == 16384
    assert cfg.optim.lr == pytest.approx(5e-4 * 2.828 / 8 * 16384 / 512, rel=1e-3)
    assert cfg.trainer.grad_clip == 1.0 and cfg.optim.eps == 1e-8 and cfg.trainer.epochs == 300
    if optim == "slamb":
        assert (cfg.optim.compress_ratio, cfg.optim.beta3, cfg.optim.sync_interval) == (0.1, 0.999, 100)


def test_digits_run_logs_eval_with_its_transform_and_keeps_the_best(digits, tmp_path):
    records = _train(digits, tmp_path, "trainer.keep_best=1", "trainer.keep_last=1", "trainer.ema_decay=0.9")
    evals = [r for r in records if "eval/top1" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for record in evals:
        assert 0.0 <= record["eval/top1"] <= record["eval/top5"] <= 100.0
        assert record["eval/images"] == 359 and record["eval/crop_pct"] == 1.0 and record["eval/resize"] == 32
        assert "eval/ema_top1" in record and math.isfinite(record["eval/ema_loss"])
    best = max(evals, key=lambda r: (r["eval/top1"], -r["step"]))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == sorted({f"step_{best['step']:08d}", "step_00000004"})
    assert (tmp_path / "hf_model" / "model.safetensors").is_file()
    assert (tmp_path / "hf_model_ema" / "model.safetensors").is_file()
    import timm
    from timm.data import resolve_data_config

    exported = timm.create_model(f"local-dir:{tmp_path / 'hf_model'}", pretrained=True)
    preprocessing = resolve_data_config({}, model=exported)  # the run's, not timm's ImageNet defaults
    assert tuple(preprocessing["mean"]) == (0.5, 0.5, 0.5) and preprocessing["crop_pct"] == 1.0
    assert tuple(preprocessing["input_size"]) == (3, 32, 32)
    train_records = [r for r in records if "loss" in r]
    assert all(math.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0 for r in train_records)


def test_resume_with_ema_and_mixup_is_exact(digits, tmp_path):
    mixed = ["trainer.ema_decay=0.5", "data.mixup_alpha=0.8", "data.cutmix_alpha=1.0",
             "data.auto_augment=rand-m9-mstd0.5-inc1", "data.re_prob=0.25", "trainer.max_steps=6",
             "trainer.eval_every=0"]
    reference = _train(digits, tmp_path / "ref", *mixed)
    _train(digits, tmp_path / "cut", *mixed, "trainer.steps_this_run=3")
    resumed = _train(digits, tmp_path / "cut", *mixed)

    def series(records):
        return [(r["step"], r["loss"], r["grad_norm"]) for r in records if "loss" in r]

    assert series(resumed) == series(reference) and len(series(reference)) == 6
    final = "checkpoints/step_00000006/shared.pt"
    a = torch.load(tmp_path / "ref" / final, weights_only=False)["ema"]
    b = torch.load(tmp_path / "cut" / final, weights_only=False)["ema"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    model = torch.load(tmp_path / "ref" / final, weights_only=False)["model"]
    assert not all(torch.equal(a[k], model[k]) for k in a)  # the EMA is its own copy


def test_optimizer_swap_needs_only_optim(digits, tmp_path):
    records = _train(digits, tmp_path, "optim=lamb", "trainer.max_steps=2")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


@pytest.mark.slow
def test_two_ranks_train_the_demo_with_slamb(digits, tmp_path):
    # min_compress_numel 100: the tiny model's tensors are mostly below SLAMB's default 9000 (synced densely)
    result = run_train(swin_digits_overrides(digits, tmp_path, "optim=slamb", "optim.lr=1e-3",
                                             "optim.min_compress_numel=100", "trainer.nproc_per_node=2",
                                             "trainer.max_steps=3"))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 < r["comm_bits_per_param"] < 32 for r in records[1:])  # masked momenta, not dense gradients
    assert (tmp_path / "checkpoints" / "step_00000003" / "rank_00001.pt").exists()
    assert any("eval/top1" in r for r in read_metrics(tmp_path))
