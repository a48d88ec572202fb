"""Metrics: cover exact match (SQuAD normalisation), yes/no answers, AUC and F1."""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

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
    if not len(scores):
        return math.nan
    x, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=int)
    return float(_weighted_auc(x, y, np.ones((1, len(x))))[0])


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


# --------------------------------------------------------------------------- bootstrap
#: Bootstrap defaults: 2000 resamples, a fixed seed, 95 % percentile intervals.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20240917
CI_LEVEL = 0.95


def bootstrap_settings(seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The bootstrap settings a summary reports (items are the resampled unit)."""
    return {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "level": CI_LEVEL, "unit": "item"}


def _resample_weights(n: int, resamples: int, seed: int) -> Any:
    """[resamples, n] counts: how often each of n items is drawn in each resample (drawing n
    with replacement), from a generator seeded with ``seed`` only."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(float)


def _mean_over_conditions(weights: Any, matrix: Any) -> Any:
    """Per resample: the mean over columns (conditions) of each column's weighted mean over
    rows (items), NaN cells skipped; [resamples] (percent when the cells are 0/1 * 100)."""
    m = np.asarray(matrix, dtype=float)
    ok = ~np.isnan(m)
    sums = weights @ np.where(ok, m, 0.0)
    counts = weights @ ok.astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        cols = sums / counts
        has = ~np.isnan(cols)
        return np.where(
            has.any(axis=1), np.nansum(cols, axis=1) / np.maximum(has.sum(axis=1), 1), np.nan
        )


def _interval(stats: Any, level: float) -> tuple[float, float]:
    s = np.asarray(stats, dtype=float)
    s = s[~np.isnan(s)]
    if not s.size:
        return (math.nan, math.nan)
    lo, hi = np.quantile(s, [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


def mean_over_conditions(matrix: Sequence[Sequence[float]]) -> float:
    """The point estimate the intervals belong to: the mean over conditions (columns) of each
    condition's mean over items (rows), NaN cells skipped."""
    m = np.asarray(matrix, dtype=float)
    return float(_mean_over_conditions(np.ones((1, m.shape[0])), m)[0]) if m.size else math.nan


def bootstrap_ci(
    matrix: Sequence[Sequence[float]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`mean_over_conditions` resampling items (rows)
    with replacement. A one-column matrix gives the interval of one condition's mean."""
    m = np.asarray(matrix, dtype=float)
    if m.ndim != 2 or not m.shape[0]:
        return (math.nan, math.nan)
    return _interval(
        _mean_over_conditions(_resample_weights(m.shape[0], resamples, seed), m), level
    )


def paired_bootstrap_diff(
    a: Sequence[Sequence[float]],
    b: Sequence[Sequence[float]],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> dict[str, Any]:
    """Policy A − policy B of the mean over conditions, on the same items (row i of ``a`` and
    of ``b`` is the same item): the difference and its bootstrap interval, with the same item
    resample for both. ``{"diff": d, "ci": [lo, hi]}``."""
    ma, mb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if ma.shape[0] != mb.shape[0]:
        raise ValueError(
            f"paired comparison needs the same items: {ma.shape[0]} vs {mb.shape[0]} rows"
        )
    if not ma.shape[0]:
        return {"diff": math.nan, "ci": [math.nan, math.nan]}
    w = _resample_weights(ma.shape[0], resamples, seed)
    diffs = _mean_over_conditions(w, ma) - _mean_over_conditions(w, mb)
    return {
        "diff": mean_over_conditions(ma) - mean_over_conditions(mb),
        "ci": list(_interval(diffs, level)),
    }


def _weighted_auc(scores: Any, labels: Any, weights: Any) -> Any:
    """AUC (ties ½) of every row of ``weights`` ([R, n] sample weights), vectorised: each
    positive's weight times the negative weight below its score (+ ½ the weight at it)."""
    order = np.argsort(scores, kind="mergesort")
    s, y, w = scores[order], labels[order].astype(bool), weights[:, order]
    neg = np.cumsum(w * ~y, axis=1)
    neg0 = np.concatenate([np.zeros((w.shape[0], 1)), neg], axis=1)  # negatives before index j
    _, start, size = np.unique(s, return_index=True, return_counts=True)
    group = np.repeat(np.arange(len(start)), size)
    below = neg0[:, start[group]]
    at = neg0[:, (start + size)[group]] - below
    pos_w = w * y
    n_pos, n_neg = pos_w.sum(axis=1), neg[:, -1]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(
            (n_pos > 0) & (n_neg > 0),
            (pos_w * (below + 0.5 * at)).sum(axis=1) / (n_pos * n_neg),
            np.nan,
        )


def bootstrap_auc_ci(
    scores: Sequence[float],
    labels: Sequence[int],
    groups: Sequence[Any] | None = None,
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = CI_LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap interval of :func:`auc`, resampling ``groups`` (e.g. the item of
    each sample: its samples are drawn together) or, without groups, samples. Resamples
    lacking one class are skipped."""
    if len(scores) != len(labels) or (groups is not None and len(groups) != len(scores)):
        raise ValueError("scores, labels and groups must have the same length")
    if not scores:
        return (math.nan, math.nan)
    keys = list(range(len(scores))) if groups is None else list(groups)
    index = {g: i for i, g in enumerate(dict.fromkeys(keys))}
    of = np.array([index[g] for g in keys])
    x, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=int)
    stats = []
    for start in range(0, resamples, 250):  # chunks keep the [R, n] weights small
        w = _resample_weights(len(index), min(250, resamples - start), seed + start)
        stats.append(_weighted_auc(x, y, w[:, of]))
    return _interval(np.concatenate(stats), level)
