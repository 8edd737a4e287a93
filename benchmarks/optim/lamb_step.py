"""Optimizer step time of our LAMB (foreach and for-loop paths) against timm's `Lamb` on BERT-sized parameters.

    python -m benchmarks.optim.lamb_step --size base              # BERT-base, 110M parameters, on the CPU
    python -m benchmarks.optim.lamb_step --size large --device cuda

Every implementation steps the same parameters with the same random gradients and NVLAMB settings
(lr 6e-3, weight decay 0.01 off biases and LayerNorm, global-norm pre-normalisation to 1.0). Steps are
interleaved across implementations, so drifting machine load hits them alike, and each reports its best
step after warm-up. Times are printed as ratios to timm's `Lamb` with its own default path, measured in
the same run. The GB/s column is the bandwidth a step would need at the minimum traffic of an ideal
fused kernel, 28 bytes per fp32 parameter (read grad, param, two moments; write param, two moments).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from timm.optim import Lamb as TimmLamb
from torch import nn

from benchmarks.common import SIZES, bert_parameters, chosen_device, device_label, step_times
from optim import LAMB, param_groups_weight_decay

NVLAMB = dict(lr=6e-3, betas=(0.9, 0.999), eps=1e-6, bias_correction=True, max_grad_norm=1.0)
MIN_BYTES_PER_PARAM = 28


def candidates(model: nn.Module) -> dict[str, torch.optim.Optimizer]:
    """Name -> optimizer over `model`; the first is the reference the others are compared with."""
    groups: Callable[[], list[dict]] = lambda: param_groups_weight_decay(model, 0.01)  # noqa: E731
    return {
        "timm Lamb, default path (reference)": TimmLamb(groups(), **NVLAMB),
        "timm Lamb, foreach=True": TimmLamb(groups(), foreach=True, **NVLAMB),
        "timm Lamb, foreach=False": TimmLamb(groups(), foreach=False, **NVLAMB),
        "ours LAMB, foreach=True": LAMB(groups(), foreach=True, **NVLAMB),
        "ours LAMB, foreach=False": LAMB(groups(), foreach=False, **NVLAMB),
    }


def best_step_times(
    optimizers: dict[str, torch.optim.Optimizer], device: torch.device, warmup: int, repeats: int
) -> dict[str, float]:
    """Best wall time of one `step()` per optimizer, in seconds, over `repeats` interleaved rounds."""
    return {name: min(values) for name, values in step_times(optimizers, device, warmup, repeats).items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per implementation (best is kept)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    device = chosen_device(parser, args.device)

    model = bert_parameters(args.size, device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    name = device_label(device)
    print(f"LAMB step, BERT-{args.size}: {numel / 1e6:.1f}M fp32 parameters in {len(params)} tensors | {name} | "
          f"torch {torch.__version__} | best of {args.repeats} after {args.warmup} warm-up steps")
    times = best_step_times(candidates(model), device, args.warmup, args.repeats)
    reference = next(iter(times.values()))
    print(f"{'implementation':<38} {'ms':>9} {'vs ref':>7} {'GB/s @28B':>10}")
    for label, seconds in times.items():
        bandwidth = MIN_BYTES_PER_PARAM * numel / seconds / 1e9
        print(f"{label:<38} {seconds * 1e3:>9.1f} {seconds / reference:>7.2f} {bandwidth:>10.1f}")


if __name__ == "__main__":
    main()
