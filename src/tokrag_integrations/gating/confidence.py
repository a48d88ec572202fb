"""ConfidenceGate: draft a short answer with the pure model, retrieve when it is not sure.

The score is one of the five Confident-RAG metrics (:mod:`.metrics`) of the draft, in the
"higher = surer" convention, so the gate retrieves when the score is *below* the threshold.
The draft is one greedy decode of the pure context; the metrics come from the
distributions that decode already produced.
"""

from __future__ import annotations

import time
from typing import Any

from .base import Gate
from .metrics import METRICS, metrics_from_result


def draft_answer(
    lm: Any, query: str, *, max_new_tokens: int = 16, policy: Any = "llm", stop: Any = ("\n",)
) -> Any:
    """One greedy answer of the pure context (a ``GenerationResult``)."""
    from ..batching import generate

    return generate(lm, query, None, policy=policy, max_new_tokens=max_new_tokens, stop=list(stop))


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
    default_percentile = 50.0

    def __init__(
        self,
        lm: Any,
        metric: str = "self_certainty",
        *,
        max_new_tokens: int = 16,
        threshold: float | None = None,
    ):
        super().__init__()
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.lm = lm
        self.metric = metric
        self.max_new_tokens = int(max_new_tokens)
        if threshold is not None:
            self.threshold = float(threshold)

    @property
    def name_with_metric(self) -> str:
        return f"confidence:{self.metric}"

    def config(self) -> dict[str, Any]:
        return {"metric": self.metric, "max_new_tokens": self.max_new_tokens}

    def score_result(self, result: Any) -> tuple[float, dict[str, Any]]:
        """Score an existing draft (no model run)."""
        m = metrics_from_result(result, self.lm.vocab_size, role="pure")
        return m.confidence[self.metric], {
            "metric": self.metric,
            "draft": result.text,
            "metrics": m.to_dict(),
        }

    def score(self, query: str) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        r = draft_answer(self.lm, query, max_new_tokens=self.max_new_tokens)
        s, d = self.score_result(r)
        d["draft_s"] = time.perf_counter() - t0
        return s, d
