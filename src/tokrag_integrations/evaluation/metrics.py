"""Metrics: cover exact match (SQuAD normalisation), yes/no answers, AUC and F1."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation) | {"‘", "’", "“", "”", "–", "—"}
_YES_NO = {"yes", "no"}


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    t = text.lower()
    t = "".join(" " if ch in _PUNCT else ch for ch in t)
    t = _ARTICLES.sub(" ", t)
    return " ".join(t.split())


def is_yes_no(answers: Sequence[str]) -> bool:
    return bool(answers) and all(normalize_answer(a) in _YES_NO for a in answers)


def first_yes_no(output: str) -> str | None:
    """The first standalone "yes" or "no" in the output (the verdict of a yes/no answer)."""
    for w in normalize_answer(output).split():
        if w in _YES_NO:
            return w
    return None


def cover_em(output: str, answers: Sequence[str]) -> bool:
    """Cover EM (seed 000, App. I.2): some normalised answer appears in the normalised output
    as a whole-word sequence. For yes/no answers the first yes/no word of the output decides
    (otherwise "no" would match "there is no doubt, yes")."""
    if not answers:
        return False
    if is_yes_no(answers):
        verdict = first_yes_no(output)
        return verdict is not None and verdict in {normalize_answer(a) for a in answers}
    out = f" {normalize_answer(output)} "
    for a in answers:
        na = normalize_answer(a)
        if na and f" {na} " in out:
            return True
    return False


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """ROC AUC = P(score of a random positive > score of a random negative), ties count 1/2.

    Returns NaN when one class is absent.
    """
    if len(scores) != len(labels):
        raise ValueError(f"got {len(scores)} scores but {len(labels)} labels")
    pairs = sorted(zip(scores, labels, strict=True), key=lambda x: x[0])
    n_pos = sum(1 for _, y in pairs if y)
    n_neg = len(pairs) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Mann–Whitney U with average ranks for ties.
    rank_sum = 0.0
    i = 0
    while i < len(pairs):
        j = i
        while j + 1 < len(pairs) and pairs[j + 1][0] == pairs[i][0]:
            j += 1
        avg = (i + j) / 2 + 1
        rank_sum += avg * sum(1 for t in range(i, j + 1) if pairs[t][1])
        i = j + 1
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def f1_score(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """F1 of the positive class (label 1 = "benefit outweighs detriment")."""
    tp = sum(1 for p, y in zip(predictions, labels, strict=True) if p and y)
    fp = sum(1 for p, y in zip(predictions, labels, strict=True) if p and not y)
    fn = sum(1 for p, y in zip(predictions, labels, strict=True) if not p and y)
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def macro_f1(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Mean of the F1 of both classes (insensitive to which class is called positive)."""
    inv_p = [1 - int(bool(p)) for p in predictions]
    inv_y = [1 - int(bool(y)) for y in labels]
    return 0.5 * (f1_score(predictions, labels) + f1_score(inv_p, inv_y))
