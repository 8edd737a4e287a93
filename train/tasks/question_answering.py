"""Extractive question answering (SQuAD v1.1): span start/end cross-entropy, and EM/F1 evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core.atomic import atomic_write_json
from data.squad.features import SquadDataset, SquadEvalData, postprocess_predictions
from data.squad.metric import squad_scores
from train.run_dir import RunDir
from train.tasks._registry import ONE_RANK, EvalShard, Task, register_task


def question_answering_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loss = mean of the start and end cross-entropies, as in BERT's SQuAD fine-tuning."""
    start_logits, end_logits = _span_logits(model, batch)
    start_loss = F.cross_entropy(start_logits.float(), batch["start_positions"])
    end_loss = F.cross_entropy(end_logits.float(), batch["end_positions"])
    with torch.no_grad():
        start_hit = start_logits.argmax(-1) == batch["start_positions"]
        exact = start_hit & (end_logits.argmax(-1) == batch["end_positions"])
    return {"loss": (start_loss + end_loss) / 2, "span_accuracy": exact.float().mean()}


def _span_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(
        input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"], attention_mask=batch["attention_mask"]
    )
    return out.start_logits, out.end_logits


def evaluate_squad(model: nn.Module, data: SquadEvalData, run_dir: RunDir,
                   shard: EvalShard = ONE_RANK) -> dict[str, float]:
    """Predict every question, write predictions.json / nbest_predictions.json, and score EM / F1.

    Each rank of `shard` predicts its batches of windows; rank 0 gathers every window's logits, post-processes
    and scores them (the other ranks return no metrics).
    """
    device = next(model.parameters()).device
    # A private generator: iterating a DataLoader otherwise draws a seed from the global RNG, which would
    # make a run that evaluated differ from one that resumed past the evaluation.
    loader = torch.utils.data.DataLoader(
        SquadDataset(data.features), batch_sampler=shard.batches(len(data.features), data.batch_size),
        generator=torch.Generator().manual_seed(0),
    )
    mine = []
    for batch in loader:
        start_logits, end_logits = _span_logits(model, {k: v.to(device) for k, v in batch.items()})
        mine.append((start_logits.float().cpu(), end_logits.float().cpu()))
    per_batch = shard.pool(mine)
    if shard.rank != 0:
        return {}
    starts, ends = zip(*per_batch, strict=True)
    predictions, nbest = postprocess_predictions(
        data.examples, data.features, torch.cat(starts).numpy(), torch.cat(ends).numpy(),
        n_best_size=data.n_best_size, max_answer_len=data.max_answer_len,
    )
    run_dir.path.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir.predictions_file, predictions, indent=2, ensure_ascii=False)
    atomic_write_json(run_dir.nbest_predictions_file, nbest, indent=2, ensure_ascii=False)
    scores = squad_scores(predictions, ((e.id, e.answers) for e in data.examples))
    return {**scores, "questions": float(len(data.examples)), "windows": float(len(data.features))}


register_task(Task("question_answering", question_answering_step, evaluate_squad))
