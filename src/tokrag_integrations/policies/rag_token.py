"""RAG-Token (seed 001): marginalise the next-token distribution over the passages.

Every kept passage z gets its own context (head + that passage + question), all sharing the
generated suffix; the next token is argmax_y Σ_z p(z|x)·p(y|x, z, y<i), with p(z|x) the softmax
of the retrievers' scores (``Passage.score``), or uniform when any score is missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..prompts import Passage, PromptPlan
from .base import Choice, ContextSpec, Lens, Policy, View


def passage_weights(passages: Sequence[Passage], temperature: float = 1.0) -> list[float]:
    """p(z|x): softmax of ``score / temperature`` over the passages, uniform if any is None."""
    n = len(passages)
    if n == 0:
        return []
    scores = [p.score for p in passages]
    if any(s is None for s in scores):
        return [1.0 / n] * n
    top = max(scores)
    ex = [math.exp((s - top) / temperature) for s in scores]
    total = sum(ex)
    return [e / total for e in ex]


def passage_posterior(weights: Sequence[float], p_token: Sequence[float]) -> list[float]:
    """p(z|x, y_i) ∝ p(z|x)·p(y_i|x, z, y<i): how much each passage contributes to the chosen
    token of the mixture (the citation of a policy with one context per passage)."""
    mass = [w * p for w, p in zip(weights, p_token, strict=True)]
    total = sum(mass)
    return [m / total for m in mass] if total > 0 else [1.0 / len(mass)] * len(mass)


def passage_role(j: int) -> str:
    return f"passage:{j}"


class RAGToken(Policy):
    """RAG-Token decoding: one context per passage, per-token mixture of their distributions.

    Args:
        temperature: divides the retrieval scores before the softmax giving p(z|x).
    """

    name = "rag_token"
    roles = ()

    def __init__(self, temperature: float = 1.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def options(self) -> dict[str, Any]:
        return {"temperature": self.temperature}

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        weights = passage_weights(plan.kept_passages, self.temperature)
        out: dict[str, ContextSpec] = {}
        for j, w in enumerate(weights):
            ids, rt = plan.single_passage_context(j)
            out[passage_role(j)] = ContextSpec(ids, rt, weight=w)
        return out

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        return [self._one(v) for v in views]

    def _one(self, views: dict[str, View]) -> Choice:
        roles = sorted(views, key=lambda r: int(r.split(":")[1]))
        probs = torch.stack([views[r].probs for r in roles])  # [K, V]
        w = torch.tensor(
            [views[r].spec.weight for r in roles], dtype=probs.dtype, device=probs.device
        )
        mixed = w @ probs
        tid = int(torch.argmax(mixed).item())
        per = probs[:, tid]
        best = roles[int(torch.argmax(w * per).item())]
        # Provenance: the passage that contributes most probability mass to the chosen token.
        return Choice(
            tid,
            best,
            {"p_mix": float(mixed[tid].item()), "p_passage": [round(float(x), 4) for x in per]},
            logits=torch.log(mixed),  # the mixture's log-probabilities
        )
