"""SQuAD v1.1: reading and checking the JSON, windowed features with offsets, and span post-processing.

Features follow BERT's recipe (NVIDIA run_squad, HF run_qa): the question (at most `max_query_len` tokens)
then a window of the context, windows `doc_stride` tokens apart, `max_seq_len` tokens in all. Answers are
recovered through each token's character offsets into the original context, so the predicted text is
exactly a substring of the context.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


class SquadFormatError(ValueError):
    """A SQuAD file that does not follow the v1.1 format; the message names the file and the item."""


@dataclass(frozen=True)
class SquadExample:
    id: str
    question: str
    context: str
    answers: tuple[str, ...]  # every gold answer text
    answer_starts: tuple[int, ...]  # their character offsets in the context


def load_squad(path: str | os.PathLike[str]) -> list[SquadExample]:
    """Read a SQuAD v1.1 JSON file, checking every field and that each answer really is in its context."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SQuAD file not found: {path}")
    try:
        with open(path, encoding="utf-8") as handle:
            articles = json.load(handle)["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise SquadFormatError(f"{path}: not a SQuAD JSON file with a top-level 'data' list ({err})") from None
    examples, seen = [], set()
    for a, article in enumerate(articles):
        for p, paragraph in enumerate(_field(article, "paragraphs", path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", path, where)
            for q, qa in enumerate(_field(paragraph, "qas", path, where)):
                item = f"{where}.qas[{q}]"
                qid, question = _field(qa, "id", path, item), _field(qa, "question", path, item)
                if qid in seen:
                    raise SquadFormatError(f"{path}: {item}: question id '{qid}' appears twice")
                seen.add(qid)
                answers = _field(qa, "answers", path, item)
                if not answers:
                    raise SquadFormatError(f"{path}: {item} (id {qid}): no answers (SQuAD v1.1 needs at least one)")
                texts, starts = [], []
                for n, answer in enumerate(answers):
                    text = _field(answer, "text", path, f"{item}.answers[{n}]")
                    start = _field(answer, "answer_start", path, f"{item}.answers[{n}]")
                    if context[start : start + len(text)] != text:
                        raise SquadFormatError(
                            f"{path}: {item} (id {qid}): answer {text!r} is not in the context at "
                            f"answer_start={start} (found {context[start : start + len(text)]!r})"
                        )
                    texts.append(text)
                    starts.append(start)
                examples.append(SquadExample(qid, question, context, tuple(texts), tuple(starts)))
    if not examples:
        raise SquadFormatError(f"{path}: no questions found")
    return examples


def _field(node: Any, key: str, path: Path, where: str) -> Any:
    if not isinstance(node, dict) or key not in node:
        raise SquadFormatError(f"{path}: {where} has no '{key}' field")
    return node[key]


@dataclass
class SquadFeatures:
    """Model inputs for every window of every example, and what post-processing needs to map back."""

    input_ids: np.ndarray  # [F, L]
    token_type_ids: np.ndarray
    attention_mask: np.ndarray
    start_positions: np.ndarray  # [F] answer start token (0 = [CLS]: the answer is not in this window)
    end_positions: np.ndarray
    example_index: np.ndarray  # [F] the example each window comes from
    offsets: list[list[tuple[int, int] | None]] = field(default_factory=list)  # context tokens only
    max_context: list[np.ndarray] = field(default_factory=list)  # [L] bool: the best window for this token

    def __len__(self) -> int:
        return len(self.input_ids)


def build_features(
    examples: list[SquadExample], tokenizer: Any, max_seq_len: int = 384, doc_stride: int = 128,
    max_query_len: int = 64,
) -> SquadFeatures:
    """Tokenise question + context into overlapping windows; label each window with the first answer."""
    questions = [_truncate_question(tokenizer, e.question, max_query_len) for e in examples]
    encoded = tokenizer(
        questions, [e.context for e in examples], truncation="only_second", max_length=max_seq_len,
        stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length",
    )
    example_index = np.asarray(encoded["overflow_to_sample_mapping"], dtype=np.int64)
    starts, ends, offsets = [], [], []
    for f, index in enumerate(example_index):
        sequence_ids = encoded.sequence_ids(f)
        context_offsets = [
            tuple(o) if s == 1 else None for o, s in zip(encoded["offset_mapping"][f], sequence_ids, strict=True)
        ]
        offsets.append(context_offsets)
        start, end = _answer_tokens(examples[index], context_offsets)
        starts.append(start)
        ends.append(end)
    features = SquadFeatures(
        input_ids=np.asarray(encoded["input_ids"], dtype=np.int64),
        token_type_ids=np.asarray(encoded["token_type_ids"], dtype=np.int64),
        attention_mask=np.asarray(encoded["attention_mask"], dtype=np.int64),
        start_positions=np.asarray(starts, dtype=np.int64),
        end_positions=np.asarray(ends, dtype=np.int64),
        example_index=example_index,
        offsets=offsets,
    )
    features.max_context = _max_context_flags(features)
    return features


def _truncate_question(tokenizer: Any, question: str, max_query_len: int) -> str:
    """Cut the question text after its first `max_query_len` tokens (NVIDIA's max_query_length)."""
    encoded = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
    if len(encoded["input_ids"]) <= max_query_len:
        return question
    return question[: encoded["offset_mapping"][max_query_len - 1][1]]


def _answer_tokens(example: SquadExample, offsets: list[tuple[int, int] | None]) -> tuple[int, int]:
    """Token span of the first gold answer inside this window, or (0, 0) when it is not wholly inside."""
    start_char = example.answer_starts[0]
    end_char = start_char + len(example.answers[0])
    context_tokens = [i for i, o in enumerate(offsets) if o is not None]
    if not context_tokens or offsets[context_tokens[0]][0] > start_char or offsets[context_tokens[-1]][1] < end_char:
        return 0, 0
    start = next(i for i in context_tokens if offsets[i][1] > start_char)
    end = next(i for i in reversed(context_tokens) if offsets[i][0] < end_char)
    return start, end


def _max_context_flags(features: SquadFeatures) -> list[np.ndarray]:
    """For each window, whether each context token has its most centred context in this window.

    BERT's rule: a token's context score in a window is min(tokens to its left, tokens to its right) plus
    a hundredth of the window length; of the windows holding the token, the best score wins. Spans that
    start on a token whose best context is elsewhere are left to that other window.
    """
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for f, offsets in enumerate(features.offsets):
        context = [i for i, o in enumerate(offsets) if o is not None]
        for position, i in enumerate(context):
            score = min(position, len(context) - 1 - position) + 0.01 * len(context)
            key = (int(features.example_index[f]), offsets[i][0])
            if key not in best or score > best[key][0]:
                best[key] = (score, f)
    flags = []
    for f, offsets in enumerate(features.offsets):
        example = int(features.example_index[f])
        flags.append(np.array([o is not None and best[(example, o[0])][1] == f for o in offsets]))
    return flags


class SquadDataset(torch.utils.data.Dataset):
    """The features as int64 tensors per window; what the QA task's step consumes."""

    KEYS = ("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions")

    def __init__(self, features: SquadFeatures) -> None:
        self.features = features

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: torch.as_tensor(getattr(self.features, key)[index]) for key in self.KEYS}


def postprocess_predictions(
    examples: list[SquadExample], features: SquadFeatures, start_logits: np.ndarray, end_logits: np.ndarray,
    n_best_size: int = 20, max_answer_len: int = 30,
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """Best answer text per question, and its n-best list with probabilities.

    For each window, the `n_best_size` highest start and end logits are paired; a pair survives if both
    tokens are context tokens, end >= start, the span is at most `max_answer_len` tokens, and the start
    token has its maximum context in this window. Score = start logit + end logit, over all windows.
    """
    windows = defaultdict(list)
    for f, example in enumerate(features.example_index):
        windows[int(example)].append(f)
    predictions, nbest = {}, {}
    for e, example in enumerate(examples):
        candidates = []
        for f in windows[e]:
            offsets, max_context = features.offsets[f], features.max_context[f]
            top_starts = np.argsort(start_logits[f])[::-1][:n_best_size]
            top_ends = np.argsort(end_logits[f])[::-1][:n_best_size]
            for s in top_starts:
                if offsets[s] is None or not max_context[s]:
                    continue
                for t in top_ends:
                    if offsets[t] is None or t < s or t - s + 1 > max_answer_len:
                        continue
                    score = float(start_logits[f][s] + end_logits[f][t])
                    candidates.append((score, offsets[s][0], offsets[t][1]))
        candidates = sorted(candidates, reverse=True)[:n_best_size] or [(0.0, 0, 0)]  # empty: an empty answer
        scores = np.array([c[0] for c in candidates])
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        nbest[example.id] = [
            {"text": example.context[start:end], "probability": float(p), "score": score}
            for (score, start, end), p in zip(candidates, probabilities, strict=True)
        ]
        predictions[example.id] = nbest[example.id][0]["text"]
    return predictions, nbest


@dataclass
class SquadEvalData:
    """A held-out SQuAD set and the post-processing settings its predictions are scored with."""

    examples: list[SquadExample]
    features: SquadFeatures
    batch_size: int = 32
    n_best_size: int = 20
    max_answer_len: int = 30


def load_squad_hub(name: str, split: str) -> list[SquadExample]:
    """SQuAD from the Hugging Face hub through `datasets` (needs the network, or a warm datasets cache)."""
    from datasets import load_dataset

    rows = load_dataset(name, split=split)
    return [
        SquadExample(row["id"], row["question"], row["context"], tuple(row["answers"]["text"]),
                     tuple(row["answers"]["answer_start"]))
        for row in rows
    ]
