"""BERT pretraining loss: masked-LM cross-entropy on the masked positions plus next-sentence prediction."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.tasks._registry import Task, register_task


def bert_pretraining_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loss = MLM + NSP, as in BERT. Unused prediction slots carry label -100 and are ignored.

    Metrics stay tensors: turning them into Python numbers would sync the device every micro-batch.
    """
    mlm_logits, nsp_logits = model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["masked_lm_positions"]
    )
    labels = batch["masked_lm_labels"]
    mlm_loss = F.cross_entropy(mlm_logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    nsp_loss = F.cross_entropy(nsp_logits.float(), batch["next_sentence_label"])
    with torch.no_grad():
        predicted = labels != -100
        mlm_correct = ((mlm_logits.argmax(-1) == labels) & predicted).sum()
        mlm_accuracy = mlm_correct / predicted.sum().clamp(min=1)
        nsp_accuracy = (nsp_logits.argmax(-1) == batch["next_sentence_label"]).float().mean()
    return {
        "loss": mlm_loss + nsp_loss,
        "mlm_loss": mlm_loss.detach(),
        "nsp_loss": nsp_loss.detach(),
        "mlm_accuracy": mlm_accuracy,
        "nsp_accuracy": nsp_accuracy,
    }


register_task(Task("bert_pretraining", bert_pretraining_step))
