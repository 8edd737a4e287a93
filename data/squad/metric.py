"""SQuAD v1.1 exact match and F1, as the official evaluate-v1.1.py defines them."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (the official order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
    """Token-overlap F1 of the normalised strings (0 when they share no token)."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict[str, str], answers: Iterable[tuple[str, Iterable[str]]]) -> dict[str, float]:
    """Mean over questions of the best EM / F1 against any gold answer, in percent.

    `answers` holds (question id, gold answer texts); a question without a prediction scores 0, as in the
    official script (which also warns about it).
    """
    total = em = f1 = 0.0
    for qid, golds in answers:
        golds = list(golds)
        total += 1
        if qid not in predictions:
            continue
        em += max(exact_match(predictions[qid], g) for g in golds)
        f1 += max(f1_score(predictions[qid], g) for g in golds)
    if total == 0:
        raise ValueError("no questions to score")
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total}
