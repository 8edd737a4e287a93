"""Swin-B training throughput (images/s) of our builder's options against plain timm, measured in one run.

    python -m benchmarks.throughput.swin_builder                          # Swin-B, batch 4, CPU (slow: ~seconds/step)
    python -m benchmarks.throughput.swin_builder --device cuda --batch 128 --precision bf16

A training step is forward + soft-target CE + backward + AdamW step on random images, as the
image-classification task runs it. Variants step in interleaved rounds, so drifting machine load hits them
alike, and each reports its best step after warm-up. The reference is `timm.create_model` with no options;
the others are `models.swin` with channels-last and/or gradient checkpointing. Forward-only (inference)
throughput is printed too, because the Swin paper's 278 img/s for Swin-B (V100, batch 64, timm) is an
inference figure: it is context for a GPU run, not a training target, and absolute CPU numbers are noise.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import chosen_device, device_label, synchronize
from models import create_model

PAPER_INFERENCE_IMG_PER_S = 278.0  # Swin-B 224, V100 (Liu et al. 2021, Table 1)
VARIANTS = {
    "timm create_model (reference)": None,
    "ours": {},
    "ours, channels_last": {"channels_last": True},
    "ours, grad_checkpointing": {"grad_checkpointing": True},
}


def build(options: dict | None, img_size: int, device: torch.device) -> nn.Module:
    if options is None:
        import timm

        model = timm.create_model("swin_base_patch4_window7_224", pretrained=False, img_size=img_size,
                                  drop_path_rate=0.5)
    else:
        model = create_model("swin", img_size=img_size, drop_path_rate=0.5, **options)
    return model.to(device).train()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (best step is kept)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else None

    torch.manual_seed(0)
    models = {name: build(VARIANTS[name], args.img_size, device) for name in args.variants}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.05) for name, m in models.items()}
    images = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device)
    targets = torch.softmax(torch.randn(args.batch, 1000, device=device), dim=-1)

    def train_step(name: str) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = models[name](images).float()
        loss = torch.sum(-targets * F.log_softmax(logits, dim=-1), dim=-1).mean()
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    @torch.no_grad()
    def infer_step(name: str) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            models[name].eval()
            models[name](images)
            models[name].train()

    def best_times(step) -> dict[str, float]:
        for name in models:
            for _ in range(args.warmup):
                step(name)
        best = dict.fromkeys(models, float("inf"))
        for _ in range(args.repeats):
            for name in models:
                synchronize(device)
                start = time.perf_counter()
                step(name)
                synchronize(device)
                best[name] = min(best[name], time.perf_counter() - start)
        return best

    where = device_label(device)
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    print(f"Swin-B {args.img_size}px, {params / 1e6:.1f}M params, batch {args.batch}, {args.precision} | {where} | "
          f"torch {torch.__version__} | best of {args.repeats} after {args.warmup} warm-up")
    train, infer = best_times(train_step), best_times(infer_step)
    reference = next(iter(train))
    print(f"{'variant':<32} {'train img/s':>11} {'vs ref':>7} {'infer img/s':>11} {'vs paper 278':>12}")
    for name in models:
        train_rate, infer_rate = args.batch / train[name], args.batch / infer[name]
        print(f"{name:<32} {train_rate:>11.2f} {train[reference] / train[name]:>7.2f} {infer_rate:>11.2f} "
              f"{infer_rate / PAPER_INFERENCE_IMG_PER_S:>12.3f}")
    print("vs ref: speed relative to plain timm in this run (higher is faster). vs paper 278: inference "
          "throughput over the paper's V100 figure; meaningful only on a GPU at batch 64 or more.")


if __name__ == "__main__":
    main()
