"""Confidence of a pure-model draft: the five Confident-RAG metrics (seed 003, Eq. 2-6) and
:class:`ConfidenceGate`, which retrieves when the draft is not sure.

Over an answer y_1..y_n with next-token distributions p_i over the vocabulary V:

* AvgLogP        = (1/n) sum_i log p_i(y_i)                      (Eq. 2, higher = surer)
* Gini           = (1/n) sum_i sum_v p_i(v)^2                    (Eq. 3, higher = surer)
* Entropy        = (1/n) sum_i -sum_v p_i(v) log p_i(v)          (Eq. 4, lower = surer)
* DP             = (1/n) sum_i exp(entropy_i)                    (Eq. 5, lower = surer)
* Self-Certainty = -(1/(n |V|)) sum_i sum_v log(|V| p_i(v))      (Eq. 6, higher = surer)

:attr:`ConfidenceScores.confidence` is always "higher = surer" (Entropy and DP negated);
``raw`` keeps the values as defined. They are computed from the per-step summaries the
decoder records in ``TraceStep.stats``, so scoring never re-runs the model;
:func:`metrics_from_probs` computes them from full distributions (the tests' reference).
The gate's score is one metric of a greedy pure-context draft; it retrieves when the score
is *below* the threshold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .gate_base import Gate

#: Metric names, in the paper's order.
METRICS: tuple[str, ...] = ("avg_logp", "gini", "entropy", "dp", "self_certainty")
#: +1 where a larger raw value means a surer answer, -1 where a smaller one does.
DIRECTION: dict[str, int] = {"avg_logp": 1, "gini": 1, "entropy": -1, "dp": -1, "self_certainty": 1}


@dataclass
class ConfidenceScores:
    """The five metrics of one answer: ``raw`` as defined, ``confidence`` higher = surer."""

    raw: dict[str, float]
    n_tokens: int
    role: str = "pure"
    mean_prob: float = float("nan")

    @property
    def confidence(self) -> dict[str, float]:
        return {k: DIRECTION[k] * v for k, v in self.raw.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "raw": dict(self.raw),
            "confidence": self.confidence,
            "n_tokens": self.n_tokens,
            "role": self.role,
            "mean_prob": self.mean_prob,
        }


def metrics_from_stats(
    steps: Sequence[Any], vocab_size: int, role: str | None = None
) -> ConfidenceScores:
    """The five metrics from decoded steps (``TraceStep`` objects or their dicts).

    Args:
        steps: the answer's steps (EOS excluded, as in ``Trace.steps``); each carries
            ``stats[role]`` recorded by the decoder.
        vocab_size: |V|, the number of logits (``lm.model.config.vocab_size`` or the logits
            width; Self-Certainty depends on it).
        role: which context's distributions to score (default: ``"pure"`` if recorded,
            else ``"rag"``, else the only role).

    Raises:
        ValueError: a step lacks the recorded statistics.
    """
    rows: list[dict[str, float]] = []
    for s in steps:
        stats = s["stats"] if isinstance(s, dict) else s.stats
        if not stats:
            raise ValueError(
                "this trace has no per-step distribution statistics; regenerate it with the "
                "current decoder (TraceStep.stats is filled by the engine's Decoder)."
            )
        if role is None:
            role = "pure" if "pure" in stats else ("rag" if "rag" in stats else next(iter(stats)))
        rows.append(stats[role])
    role = role or "pure"
    n = len(rows)
    if n == 0:
        return ConfidenceScores({k: float("nan") for k in METRICS}, 0, role)
    log_v = math.log(vocab_size)
    raw = {
        "avg_logp": sum(r["logp"] for r in rows) / n,
        "gini": sum(r["gini"] for r in rows) / n,
        "entropy": sum(r["entropy"] for r in rows) / n,
        "dp": sum(math.exp(r["entropy"]) for r in rows) / n,
        # -(1/|V|) sum_v log(|V| p(v)) = -log|V| - mean_v log p(v)
        "self_certainty": sum(-log_v - r["mean_logp"] for r in rows) / n,
    }
    mean_prob = sum(math.exp(r["logp"]) for r in rows) / n
    return ConfidenceScores(raw, n, role, mean_prob)


def check_metric(metric: str) -> str:
    """``metric`` if it is one of :data:`METRICS`, else ValueError."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    return metric


def metrics_from_probs(probs: torch.Tensor, token_ids: Sequence[int]) -> ConfidenceScores:
    """Reference implementation on full distributions.

    Args:
        probs: [n, V] next-token distributions (rows sum to 1).
        token_ids: the n chosen tokens.
    """
    if probs.ndim != 2 or probs.shape[0] != len(token_ids):
        raise ValueError(f"probs must be [n, V] with n = len(token_ids); got {tuple(probs.shape)}")
    p = probs.double()
    n, v = p.shape
    logp = torch.log(p)
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(p))).sum(-1)
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    raw = {
        "avg_logp": float(logp[torch.arange(n), ids].mean()),
        "gini": float((p * p).sum(-1).mean()),
        "entropy": float(ent.mean()),
        "dp": float(torch.exp(ent).mean()),
        "self_certainty": float((-torch.log(v * p)).sum() / (n * v)),
    }
    mean_prob = float(p[torch.arange(n), ids].mean())
    return ConfidenceScores(raw, n, "probs", mean_prob)


def draft_answer(lm: Any, query: str, *, max_new_tokens: int = 16) -> Any:
    """One greedy answer of the pure context (a ``GenerationResult``)."""
    from ..engine.scheduler import generate

    return generate(lm, query, None, policy="no_rag", max_new_tokens=max_new_tokens, stop=["\n"])


class ConfidenceGate(Gate):
    """Retrieve when the pure model's draft answer is not confident enough.

    Args:
        lm: a ``LoadedModel``.
        metric: one of ``avg_logp``, ``gini``, ``entropy``, ``dp``, ``self_certainty``
            (the poster's best for Confident-RAG were Self-Certainty and DP).
        max_new_tokens: length of the draft.
        threshold: a fixed threshold on the confidence (else :meth:`calibrate`).
    """

    name = "confidence"
    retrieve_when = "below"

    config_keys = ("metric", "max_new_tokens")

    def __init__(
        self,
        lm: Any,
        metric: str = "self_certainty",
        *,
        max_new_tokens: int = 16,
        threshold: float | None = None,
    ):
        self.metric = check_metric(metric)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        super().__init__(threshold)
        self.lm = lm
        self.max_new_tokens = int(max_new_tokens)

    def score(self, query: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        r = draft_answer(self.lm, query, max_new_tokens=self.max_new_tokens)
        m = metrics_from_stats(r.trace.steps, self.lm.vocab_size, role="pure")
        return m.confidence[self.metric], {
            "metric": self.metric,
            "draft": r.text,
            "metrics": m.to_dict(),
            "draft_s": time.perf_counter() - t0,
        }
