"""SQuAD v1.1: reading and checking the JSON, windowed features with offsets, and span post-processing.

Features follow BERT's recipe (BERT's and NVIDIA's run_squad): the question (at most `max_query_len` tokens)
then a window of the context, `max_seq_len` tokens in all. `doc_stride` is the distance between the starts of
consecutive windows, as in BERT's run_squad (not the overlap, which is what a fast tokenizer's `stride` means);
the last window ends at the end of the context. Answers are recovered through each token's character offsets
into the original context, so the predicted text is exactly a substring of the context.
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

from core.errors import UserError


class SquadFormatError(UserError, ValueError):
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
        for p, paragraph in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", str, path, where)
            for q, qa in enumerate(_field(paragraph, "qas", list, path, where)):
                item = f"{where}.qas[{q}]"
                qid, question = _field(qa, "id", str, path, item), _field(qa, "question", str, path, item)
                if qid in seen:
                    raise SquadFormatError(f"{path}: {item}: question id '{qid}' appears twice")
                seen.add(qid)
                answers = _field(qa, "answers", list, path, item)
                if not answers:
                    raise SquadFormatError(f"{path}: {item} (id {qid}): no answers (SQuAD v1.1 needs at least one)")
                texts, starts = [], []
                for n, answer in enumerate(answers):
                    text = _field(answer, "text", str, path, f"{item}.answers[{n}]")
                    start = _field(answer, "answer_start", int, path, f"{item}.answers[{n}]")
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


def _field(node: Any, key: str, kind: type, path: Path, where: str) -> Any:
    """`node[key]`, which must be a `kind` (an int is not a bool); else one line naming the file and item."""
    if not isinstance(node, dict) or key not in node:
        raise SquadFormatError(f"{path}: {where} has no '{key}' field")
    value = node[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise SquadFormatError(f"{path}: {where}.{key} must be {_KIND_NAMES[kind]}, not {value!r}")
    return value


_KIND_NAMES = {str: "a string", int: "an integer", list: "a list"}


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
    """Tokenise question + context into windows `doc_stride` tokens apart; label each with the first answer.

    The windows are BERT run_squad's doc spans: [CLS] question [SEP] context window [SEP], the question cut to
    `max_query_len` tokens, each window at most `max_seq_len - len(question) - 3` context tokens; a window
    starts `doc_stride` tokens after the previous one (never past its end), and the last window ends at the
    end of the context. (A fast tokenizer's own `stride` is the overlap between windows, not this distance.)
    """
    if not examples:
        raise ValueError("build_features: no examples")
    questions = tokenizer([e.question for e in examples], add_special_tokens=False)["input_ids"]
    contexts = sorted({e.context for e in examples})  # questions share paragraphs: tokenise each one once
    encoded = tokenizer(contexts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    context_tokens = {
        c: (ids, [tuple(o) for o in offsets])
        for c, ids, offsets in zip(contexts, encoded["input_ids"], encoded["offset_mapping"], strict=True)
    }
    cls_id, sep_id, pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    columns: dict[str, list[Any]] = defaultdict(list)
    for index, (example, question) in enumerate(zip(examples, questions, strict=True)):
        question = question[:max_query_len]
        doc_ids, doc_offsets = context_tokens[example.context]
        max_tokens_for_doc = max_seq_len - len(question) - 3
        if max_tokens_for_doc < 1:
            raise ValueError(
                f"max_seq_len={max_seq_len} leaves no room for context after a {len(question)}-token question "
                f"(max_query_len={max_query_len}) and the 3 special tokens"
            )
        answer = _answer_tokens(example, doc_offsets)
        spans = doc_spans(len(doc_ids), max_tokens_for_doc, doc_stride)
        owner = _max_context_owner(spans, len(doc_ids))
        for span_index, (span_start, span_length) in enumerate(spans):
            first = len(question) + 2  # [CLS] question [SEP]
            span_ids = doc_ids[span_start : span_start + span_length]
            ids = [cls_id, *question, sep_id, *span_ids, sep_id]
            padding = max_seq_len - len(ids)
            columns["input_ids"].append(ids + [pad_id] * padding)
            columns["token_type_ids"].append([0] * first + [1] * (span_length + 1) + [0] * padding)
            columns["attention_mask"].append([1] * len(ids) + [0] * padding)
            columns["offsets"].append(
                [None] * first + doc_offsets[span_start : span_start + span_length] + [None] * (padding + 1)
            )
            max_context = np.zeros(max_seq_len, dtype=bool)
            max_context[first : first + span_length] = owner[span_start : span_start + span_length] == span_index
            columns["max_context"].append(max_context)
            if answer is not None and span_start <= answer[0] and answer[1] < span_start + span_length:
                columns["start_positions"].append(answer[0] - span_start + first)
                columns["end_positions"].append(answer[1] - span_start + first)
            else:  # the answer is not wholly inside this window: point at [CLS]
                columns["start_positions"].append(0)
                columns["end_positions"].append(0)
            columns["example_index"].append(index)
    return SquadFeatures(
        **{key: np.asarray(columns[key], dtype=np.int64) for key in (
            "input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions", "example_index")},
        offsets=columns["offsets"], max_context=columns["max_context"],
    )


def doc_spans(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of each context window, as BERT run_squad: starts `doc_stride` apart, the last at the end."""
    spans, start = [], 0
    while True:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == num_tokens:
            return spans
        start += min(length, doc_stride)


def _answer_tokens(example: SquadExample, offsets: list[tuple[int, int]]) -> tuple[int, int] | None:
    """First and last context token of the first gold answer (character overlap), or None if no token covers it."""
    start_char = example.answer_starts[0]
    end_char = start_char + len(example.answers[0])
    covering = [i for i, (a, b) in enumerate(offsets) if a < end_char and b > start_char]
    return (covering[0], covering[-1]) if covering else None


def _max_context_owner(spans: list[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """For each context token, the window where its context is maximal (BERT's _check_is_max_context).

    A token's score in a window is min(tokens to its left, tokens to its right) + 0.01 * the window length; of
    the windows holding the token, the highest score wins (the first on a tie).
    """
    best = np.full(num_tokens, -np.inf)
    owner = np.full(num_tokens, -1, dtype=np.int64)
    for index, (start, length) in enumerate(spans):
        position = np.arange(length)
        score = np.minimum(position, length - 1 - position) + 0.01 * length
        better = score > best[start : start + length]
        best[start : start + length][better] = score[better]
        owner[start : start + length][better] = index
    return owner


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
    token has its maximum context in this window. Score = start logit + end logit, over all windows; the
    n-best list keeps the `n_best_size` best distinct texts (a span whose text is already listed is skipped,
    as in BERT run_squad), and the probabilities are a softmax over those.
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
        best, seen = [], set()
        for score, start, end in sorted(candidates, reverse=True):
            text = example.context[start:end]
            if text in seen:  # run_squad's seen_predictions: a text already in the list is not listed again
                continue
            seen.add(text)
            best.append((score, text))
            if len(best) == n_best_size:
                break
        best = best or [(0.0, "")]  # no valid span: an empty answer
        scores = np.array([score for score, _ in best])
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        nbest[example.id] = [
            {"text": text, "probability": float(p), "score": score}
            for (score, text), p in zip(best, probabilities, strict=True)
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
