"""BERT pretraining loss: masked-LM cross-entropy on the masked positions plus next-sentence prediction."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from train.run_dir import RunDir
from train.tasks._registry import ONE_RANK, EvalShard, Task, register_task

PACKING_KEYS = ("position_ids", "cls_positions")  # what a packed batch adds (data.text.packing)


def _logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM logits [B, P, V] and NSP logits, [B, 2] or, for packed rows, [B, K, 2]."""
    packing = {key: batch[key] for key in PACKING_KEYS if key in batch}
    return model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["masked_lm_positions"],
                 **packing)


def bert_pretraining_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loss = MLM + NSP, as in BERT. Unused prediction slots carry label -100 and are ignored, and so do the unused
    NSP slots of packed rows: the MLM loss is the mean over every masked token of the batch and the NSP loss the mean
    over its sequences, so a packed batch has the loss of its sequences unpacked.

    Metrics stay tensors: turning them into Python numbers would sync the device every micro-batch.
    """
    mlm_logits, nsp_logits = _logits(model, batch)
    labels, nsp_labels = batch["masked_lm_labels"], batch["next_sentence_label"].flatten()
    mlm_loss = F.cross_entropy(mlm_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    nsp_loss = F.cross_entropy(nsp_logits.flatten(0, -2).float(), nsp_labels, ignore_index=-100)
    with torch.no_grad():
        predicted, sequences = labels != -100, nsp_labels != -100
        mlm_correct = ((mlm_logits.argmax(-1) == labels) & predicted).sum()
        mlm_accuracy = mlm_correct / predicted.sum().clamp(min=1)
        nsp_correct = ((nsp_logits.flatten(0, -2).argmax(-1) == nsp_labels) & sequences).sum()
        nsp_accuracy = nsp_correct / sequences.sum().clamp(min=1)
        # Real (non-pad) tokens per sample (a row, when packed): x samples/s = tokens/s.
        tokens_per_seq = (batch["attention_mask"] != 0).sum(-1).float().mean()
    metrics = {
        "loss": mlm_loss + nsp_loss,
        "mlm_loss": mlm_loss.detach(),
        "nsp_loss": nsp_loss.detach(),
        "mlm_accuracy": mlm_accuracy,
        "nsp_accuracy": nsp_accuracy,
        "tokens_per_seq": tokens_per_seq,
    }
    if "cls_positions" in batch:
        metrics["sequences_per_row"] = sequences.sum() / batch["cls_positions"].size(0)
    return metrics


def evaluate_bert_pretraining(model: nn.Module, data: Any, run_dir: RunDir,
                              shard: EvalShard = ONE_RANK) -> dict[str, float]:
    """MLM and NSP loss and accuracy over the whole held-out set (the paper's "BERT validation loss" is `loss`).

    `data` is the text kinds' held-out set (`batches`, `dataset`, `batch_size`). The MLM loss is the mean over
    every masked token of the set and the NSP loss the mean over its sequences, not means of batch means, so
    neither depends on the batch size or on how the ranks of `shard` split the batches.
    """
    device = next(model.parameters()).device
    mine = []
    for batch in data.batches(shard.batches(len(data.dataset), data.batch_size)):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        mlm_logits, nsp_logits = _logits(model, batch)
        labels, nsp_labels = batch["masked_lm_labels"], batch["next_sentence_label"].flatten()
        nsp_logits = nsp_logits.flatten(0, -2)
        predicted, sequences = labels != -100, nsp_labels != -100
        sums = torch.stack([
            F.cross_entropy(mlm_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                            reduction="sum").double(),
            ((mlm_logits.argmax(-1) == labels) & predicted).sum().double(),
            predicted.sum().double(),
            F.cross_entropy(nsp_logits.float(), nsp_labels, ignore_index=-100, reduction="sum").double(),
            ((nsp_logits.argmax(-1) == nsp_labels) & sequences).sum().double(),
            sequences.sum().double(),
        ])
        mine.append(sums.tolist())  # one host read per batch
    per_batch = shard.pool(mine)
    mlm_loss, mlm_correct, tokens, nsp_loss, nsp_correct, sequences = (sum(b[i] for b in per_batch) for i in range(6))
    if sequences == 0:
        raise ValueError("the held-out text set is empty")
    return {
        "loss": mlm_loss / tokens + nsp_loss / sequences,
        "mlm_loss": mlm_loss / tokens,
        "nsp_loss": nsp_loss / sequences,
        "mlm_accuracy": mlm_correct / tokens,
        "nsp_accuracy": nsp_correct / sequences,
        "sequences": float(sequences),
    }


register_task(Task("bert_pretraining", bert_pretraining_step, evaluate_bert_pretraining))
