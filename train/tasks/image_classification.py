"""Image classification: cross-entropy (soft-target under mixup / label smoothing), top-1/top-5 evaluation."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.run_dir import RunDir
from train.tasks._registry import ONE_RANK, EvalShard, Task, register_task


def image_classification_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loss = CE against `target` (mixed / smoothed class distributions) when the batch has one, else `label`.

    `accuracy` compares with the unmixed labels: under mixup it is a rough progress signal (the image shows
    two classes), not a held-out accuracy. Metrics stay tensors (no device sync per micro-batch).
    """
    logits = model(batch["image"]).float()
    if "target" in batch:  # timm's SoftTargetCrossEntropy: -sum(target * log_softmax)
        loss = torch.sum(-batch["target"] * F.log_softmax(logits, dim=-1), dim=-1).mean()
    else:
        loss = F.cross_entropy(logits, batch["label"])
    with torch.no_grad():
        accuracy = (logits.argmax(-1) == batch["label"]).float().mean()
    return {"loss": loss, "accuracy": accuracy}


def evaluate_image_classification(model: nn.Module, data: Any, run_dir: RunDir,
                                  shard: EvalShard = ONE_RANK) -> dict[str, float]:
    """Top-1 / top-5 (percent) and mean CE over the whole held-out set, plus the eval transform's geometry.

    `data` is a `data.images.transforms.EvalImages`. Its `protocol` (resize, crop, crop_pct) is returned with the
    accuracies, so every logged top-1 carries the transform it was measured with: the crop protocol alone
    moves ImageNet top-1 by about 0.1. Each rank of `shard` evaluates its batches; the per-batch sums are pooled.
    """
    device = next(model.parameters()).device
    mine = []
    for batch in data.batches(shard.batches(len(data.dataset), data.batch_size)):
        images = batch["image"].to(device, non_blocking=True)
        labels = batch["label"].to(device, non_blocking=True)
        logits = model(images).float()
        top = logits.topk(min(5, logits.size(-1)), dim=-1).indices
        hits = top == labels[:, None]
        sums = torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(), hits[:, 0].sum().double(),
                            hits.any(dim=-1).sum().double()])
        mine.append((*sums.tolist(), labels.numel()))  # one host read per batch
    per_batch = shard.pool(mine)
    loss_sum, correct1, correct5, seen = (sum(batch[i] for batch in per_batch) for i in range(4))  # in batch order
    if seen == 0:
        raise ValueError("the held-out image set is empty")
    return {
        "top1": 100.0 * correct1 / seen,
        "top5": 100.0 * correct5 / seen,
        "loss": loss_sum / seen,
        "images": float(seen),
        **data.protocol,
    }


register_task(Task("image_classification", image_classification_step, evaluate_image_classification, sample_unit="img"))
