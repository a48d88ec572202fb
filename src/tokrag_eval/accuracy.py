"""Accuracy summaries of the noise-sweep and misleading runs: per policy and condition, with
95 % percentile-bootstrap intervals and the paired difference to ``rag``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from .data import EvalItem
from .metrics import (
    BOOTSTRAP_SEED,
    bootstrap_ci,
    bootstrap_settings,
    first_yes_no,
    is_yes_no,
    mean_over_conditions,
    paired_bootstrap_diff,
)
from .records import NO_PASSAGES

__all__ = ["compare_policies", "item_matrix", "summarize_accuracy"]

#: (policy, condition, item) -> record.
Index = dict[tuple[str, str, str], dict[str, Any]]


def _index(records: Iterable[dict[str, Any]], ids: set[str]) -> Index:
    return {(r["policy"], r["condition"], r["item"]): r for r in records if r["item"] in ids}


def _record(index: Index, policy: str, condition: str, item_id: str) -> dict[str, Any] | None:
    """The record of ``policy`` on ``item_id`` under ``condition``; ``no_rag`` records (condition
    ``none``) stand for every condition."""
    return index.get((policy, condition, item_id)) or index.get((policy, NO_PASSAGES, item_id))


def item_matrix(
    index: Index,
    items: Sequence[EvalItem],
    policy: str,
    conditions: Sequence[str],
    key: str = "correct",
) -> list[list[float]]:
    """Rows = items, columns = conditions: 100 if the record's ``key`` is true, 0 if false,
    NaN where there is no record or the value is None. ``no_rag`` records (condition ``none``)
    fill every condition."""

    def cell(it: EvalItem, c: str) -> float:
        r = _record(index, policy, c, it.id)
        v = None if r is None else r.get(key)
        return math.nan if v is None else 100.0 * bool(v)

    return [[cell(it, c) for c in conditions] for it in items]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _figures(
    name: str,
    index: Index,
    items: Sequence[EvalItem],
    policies: Sequence[str],
    conditions: Sequence[str],
    key: str,
    seed: int,
) -> dict[str, Any]:
    """``name`` (per policy and condition), ``name_ci`` (bootstrap CI), ``name_mean`` and
    ``name_mean_ci`` (over conditions, items resampled) of the records' ``key``."""
    out: dict[str, Any] = {name: {}, f"{name}_ci": {}, f"{name}_mean": {}, f"{name}_mean_ci": {}}
    for p in policies:
        m = item_matrix(index, items, p, conditions, key)
        cols = {c: [[row[j]] for row in m] for j, c in enumerate(conditions)}
        out[name][p] = {c: mean_over_conditions(col) for c, col in cols.items()}
        out[f"{name}_ci"][p] = {c: list(bootstrap_ci(col, seed=seed)) for c, col in cols.items()}
        out[f"{name}_mean"][p] = mean_over_conditions(m)
        out[f"{name}_mean_ci"][p] = list(bootstrap_ci(m, seed=seed))
    return out


def compare_policies(
    records: Iterable[dict[str, Any]],
    items: Sequence[EvalItem],
    a: str,
    b: str,
    conditions: Sequence[str],
    key: str = "correct",
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """Policy ``a`` − policy ``b`` of the mean over conditions of ``key`` (percent) on the same
    items, with the paired bootstrap 95 % interval: ``{"diff": d, "ci": [lo, hi]}``. "a is
    not below b within the 95 % interval" reads ``ci[1] >= 0``."""
    index = _index(records, {it.id for it in items})
    return paired_bootstrap_diff(
        item_matrix(index, items, a, conditions, key),
        item_matrix(index, items, b, conditions, key),
        seed=seed,
    )


def summarize_accuracy(
    records: Iterable[dict[str, Any]],
    items: Sequence[EvalItem],
    policies: Sequence[str],
    conditions: Sequence[str],
    baseline: str = "rag",
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """Accuracy / counterfactual-repeat rate / time per policy and condition (percent), with
    95 % bootstrap intervals (items resampled) per condition and for the mean over conditions,
    and the paired difference of every policy to ``baseline`` (when it was run). ``no_rag``
    records count for every condition; only the given items enter the figures.
    """
    records = list(records)
    items = list({it.id: it for it in items}.values())
    ids = {it.id for it in items}
    index = _index(records, ids)
    out: dict[str, Any] = {
        "policies": list(policies),
        "conditions": list(conditions),
        "n_items": len(ids),
        "bootstrap": bootstrap_settings(seed),
    }
    out.update(_figures("accuracy", index, items, policies, conditions, "correct", seed))
    out.update(_figures("cf_repeat", index, items, policies, conditions, "cf_repeat", seed))
    out["n"] = {
        p: {
            c: sum(1 for row in item_matrix(index, items, p, [c]) if not math.isnan(row[0]))
            for c in conditions
        }
        for p in policies
    }
    if baseline in policies:
        out["paired_baseline"] = baseline
        out["paired"] = {
            p: {
                k: compare_policies(records, items, p, baseline, conditions, f, seed)
                for k, f in (("accuracy", "correct"), ("cf_repeat", "cf_repeat"))
            }
            for p in policies
            if p != baseline
        }
    yes_no = [it for it in items if is_yes_no(it.answers)]
    if yes_no:
        out.update(_verdict_figures(index, yes_no, policies, conditions, seed))
    out["mean_tokens"] = {p: _mean_tokens(index, items, p, conditions) for p in policies}
    if baseline in policies:
        out["length_ratio"] = {
            p: _ratio(
                _mean_tokens(index, items, p, conditions, paired_with=baseline),
                _mean_tokens(index, items, baseline, conditions, paired_with=p),
            )
            for p in policies
            if p != baseline
        }
    out["mean_time_s"] = {
        p: _mean(
            [r["time_s"] for c in conditions for it in items if (r := _record(index, p, c, it.id))]
        )
        for p in policies
    }
    out["mean_passages"], out["items_short"] = _passage_counts(records, ids, conditions)
    return out


def _verdict_figures(
    index: Index,
    items: Sequence[EvalItem],
    policies: Sequence[str],
    conditions: Sequence[str],
    seed: int,
) -> dict[str, Any]:
    """Yes/no items: the share of answers that state a verdict (a standalone yes or no,
    :func:`.metrics.first_yes_no`) and the accuracy among those answers, per policy and
    condition (percent, 95 % bootstrap intervals over items)."""
    verdicts = {}
    for key, r in index.items():
        stated = first_yes_no(r["text"]) is not None
        verdicts[key] = {
            **r,
            "verdict": stated,
            "verdict_correct": r["correct"] if stated else None,
        }
    return {
        "n_yes_no_items": len(items),
        **_figures("verdict_rate", verdicts, items, policies, conditions, "verdict", seed),
        **_figures(
            "verdict_accuracy", verdicts, items, policies, conditions, "verdict_correct", seed
        ),
    }


def _tokens(r: dict[str, Any] | None) -> int | None:
    return None if r is None or "counts" not in r else sum(r["counts"].values())


def _mean_tokens(
    index: Index,
    items: Sequence[EvalItem],
    policy: str,
    conditions: Sequence[str],
    paired_with: str | None = None,
) -> float:
    """Mean generated tokens per answer; with ``paired_with``, only over the (item, condition)
    cells both policies answered."""
    lengths = []
    for c in conditions:
        for it in items:
            n = _tokens(_record(index, policy, c, it.id))
            if n is not None and (
                paired_with is None or _tokens(_record(index, paired_with, c, it.id)) is not None
            ):
                lengths.append(n)
    return _mean(lengths)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _passage_counts(
    records: list[dict[str, Any]], ids: set[str], conditions: Sequence[str]
) -> tuple[dict[str, Any], dict[str, int]]:
    passages: dict[str, dict[str, float]] = {}
    short: dict[str, int] = {}
    for c in conditions:
        first = {r["item"]: r for r in records if r["item"] in ids and r["condition"] == c}
        short[c] = sum(1 for r in first.values() if r.get("short"))
        if first:
            passages[c] = {
                kind: round(sum(r["passages"].get(kind, 0) for r in first.values()) / len(first), 2)
                for kind in ("pos", "neg", "cf")
            }
    return passages, short
