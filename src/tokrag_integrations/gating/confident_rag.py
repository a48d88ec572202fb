"""Confident-RAG (seed 003): one RAG answer per retriever, keep the most confident one.

Each retriever (e.g. dense MiniLM and BM25, or several embedding models) retrieves for the
query; the model answers once per retriever; each answer is scored with one confidence
metric (:mod:`.confidence`, from the decoder's own distributions); the answer with the highest
confidence ("higher = surer") is returned with every candidate and score. The poster's best
metrics were Self-Certainty and DP.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .confidence import check_metric, metrics_from_stats


@dataclass
class ConfidentRAGResult:
    """The chosen answer and all candidates (``retriever``, ``text``, ``confidence``,
    ``metrics``, ``passages``, ``seconds``), best first."""

    text: str
    retriever: str
    metric: str
    confidence: float
    candidates: list[dict[str, Any]] = field(default_factory=list)
    result: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "retriever": self.retriever,
            "metric": self.metric,
            "confidence": self.confidence,
            "candidates": [{k: v for k, v in c.items() if k != "result"} for c in self.candidates],
        }


def confident_rag(
    lm: Any,
    query: str,
    retrievers: Mapping[str, Any] | Sequence[Any],
    *,
    metric: str = "self_certainty",
    top_k: int = 3,
    policy: str = "rag",
    max_new_tokens: int = 32,
    stop: Sequence[str] = ("\n",),
) -> ConfidentRAGResult:
    """Answer ``query`` once per retriever and keep the most confident answer.

    Args:
        retrievers: name -> object with ``retrieve(query, top_k)`` (the project's
            ``DenseRetriever`` / ``BM25Retriever``) or a callable returning passages; a
            list gets names ``r0, r1, ...``.
        metric: the confidence metric that picks the answer.
        policy: decoding policy of each RAG answer (the metric reads the RAG context's
            distributions).
    """
    check_metric(metric)
    named = (
        dict(retrievers)
        if isinstance(retrievers, Mapping)
        else {f"r{i}": r for i, r in enumerate(retrievers)}
    )
    if not named:
        raise ValueError("confident_rag needs at least one retriever.")
    from ..engine.scheduler import generate

    cands = []
    for name, ret in named.items():
        t0 = time.perf_counter()
        hits = ret.retrieve(query, top_k=top_k) if hasattr(ret, "retrieve") else ret(query)
        passages = [getattr(h, "text", h) for h in hits]
        r = generate(
            lm, query, passages, policy=policy, max_new_tokens=max_new_tokens, stop=list(stop)
        )
        role = "rag" if r.trace.steps and "rag" in r.trace.steps[0].stats else None
        m = metrics_from_stats(r.trace.steps, lm.vocab_size, role=role)
        cands.append(
            {
                "retriever": name,
                "text": r.text,
                "confidence": m.confidence[metric],
                "metrics": m.to_dict(),
                "passages": passages,
                "seconds": time.perf_counter() - t0,
                "result": r,
            }
        )
    ranked = sorted(
        cands,
        key=lambda c: c["confidence"] if c["confidence"] == c["confidence"] else float("-inf"),
        reverse=True,
    )
    best = ranked[0]
    return ConfidentRAGResult(
        best["text"], best["retriever"], metric, best["confidence"], ranked, best["result"]
    )
