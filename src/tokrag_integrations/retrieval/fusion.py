"""Reciprocal rank fusion: the one fusion of hybrid retrieval, for folders (dense + BM25,
:class:`.index.HybridRetriever`) and Postgres (vector + full text, ``search="hybrid"``).

Kept here rather than taken from a framework: LlamaIndex's ``QueryFusionRetriever`` and
LangChain's ``EnsembleRetriever`` fuse inside their own retriever classes (and unweighted or
without a tie rule), which neither the folder retrievers nor the Postgres store are.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, TypeVar

__all__ = ["RRF_K", "CANDIDATES", "check_fusion", "reciprocal_rank_fusion"]

#: The rank offset k of reciprocal rank fusion (Cormack et al. 2009).
RRF_K = 60.0

#: Candidates each ranking gives the fusion (at least ``top_k``).
CANDIDATES = 50

K = TypeVar("K", bound=Hashable)  # and orderable: equal scores are ordered by item


def check_fusion(rrf_k: Any, vector_weight: Any, text_weight: Any) -> tuple[float, float, float]:
    """``(rrf_k, vector_weight, text_weight)`` as floats, or a ``ValueError`` naming the bad
    one: ``rrf_k`` positive and finite, the weights finite and >= 0, not both 0."""
    for name, value in (
        ("rrf_k", rrf_k),
        ("vector_weight", vector_weight),
        ("text_weight", text_weight),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
            raise ValueError(f"{name} must be a number, got {value!r}.")
        if value < 0 or (name == "rrf_k" and value == 0) or value == float("inf"):
            raise ValueError(
                f"{name} must be {'positive' if name == 'rrf_k' else '>= 0'} and finite, got {value!r}."
            )
    if vector_weight == 0 and text_weight == 0:
        raise ValueError("vector_weight and text_weight are both 0; give at least one a weight.")
    return float(rrf_k), float(vector_weight), float(text_weight)


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[K]], weights: Sequence[float], rrf_k: float = RRF_K
) -> list[tuple[K, float]]:
    """Items of ``rankings`` (each best first, without repeats) by fused score, best first:
    ``score(d) = sum_i weights[i] / (rrf_k + rank_i(d))``, ranks from 1, a ranking that
    lacks ``d`` adding nothing. Equal scores put the smaller item first (the chunk's position
    in a folder, the row key in Postgres), so the order never depends on the input's."""
    if len(weights) != len(rankings):
        raise ValueError(f"{len(rankings)} rankings but {len(weights)} weights.")
    scores: dict[K, float] = {}
    for ranking, weight in zip(rankings, weights, strict=True):
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + weight / (rrf_k + rank)
    return sorted(scores.items(), key=lambda pair: (-pair[1], pair[0]))
