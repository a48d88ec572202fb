"""RAG-Sequence (seed 001): one answer per passage, rescored under every passage.

A :class:`.base.SequencePolicy`, decoded by the engine's loop (:mod:`..engine.loop`):

1. For each kept passage z, a greedy answer y_z from a context holding only z (standard RAG
   over single-passage prompts; :meth:`RAGSequence.candidate_plans`).
2. Each distinct candidate y scored under every passage:
   p(y|x) = Σ_z p(z|x)·Π_i p(y_i|x, z, y<i), with p(z|x) as in RAG-Token (softmax of the
   retrieval scores, uniform when any is missing; :meth:`RAGSequence.log_p`).
3. The candidate with the highest p(y|x) is the answer. Step 0 of the trace carries every
   candidate, the passage that produced it and its log-scores (``signals["rag_sequence"]``).

A candidate that ended with EOS is scored with its EOS (so an empty answer pays for stopping
at once); one cut by ``max_new_tokens`` or a stop string is scored on its tokens only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..prompts import PromptPlan
from ..trace import FROM_PURE
from .base import ContextSpec, Policy, SequencePolicy
from .baselines import NoRAG, StandardRAG
from .rag_token import RAGToken, passage_role


def single_passage_plan(plan: PromptPlan, j: int) -> PromptPlan:
    """A copy of ``plan`` whose RAG context holds only kept passage ``j``."""
    ids, rt = plan.single_passage_context(j)
    span = [(rt[0], rt[-1] + 1)] if rt else []
    return dataclasses.replace(
        plan,
        rag_ids=ids,
        passage_spans=span,
        passage_segments=[plan.passage_segments[j]],
        kept_passages=[plan.kept_passages[j]],
    )


class RAGSequence(SequencePolicy):
    """RAG-Sequence decoding (thorough: every candidate scored under every passage).

    Args:
        temperature: divides the retrieval scores before the softmax giving p(z|x).
    """

    name = "rag_sequence"
    roles = ()
    #: Step 1's rule for the single-passage candidates, and for a query without passages.
    candidate_policy: Policy = StandardRAG()
    fallback_policy: Policy = NoRAG()

    def __init__(self, temperature: float = 1.0):
        self._scorer = RAGToken(temperature=temperature)
        self.temperature = float(temperature)

    def options(self) -> dict[str, Any]:
        return {"temperature": self.temperature}

    def candidate_plans(self, plan: PromptPlan) -> list[PromptPlan]:
        """Step 1's prompts: one per kept passage (none without passages)."""
        return [single_passage_plan(plan, j) for j in range(len(plan.passage_spans))]

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        """Step 2's contexts: one per kept passage, weighted by p(z|x) (RAG-Token's)."""
        return self._scorer.contexts(plan)

    def log_p(self, weights: Sequence[float | None], log_p_passages: Sequence[float]) -> float:
        """log p(y|x) = log Σ_z p(z|x)·p(y|x, z) from the candidate's log p(y|x, z) per
        passage (passages of weight 0 left out; 0.0 where there is none)."""
        terms = [math.log(w) + lp for w, lp in zip(weights, log_p_passages, strict=True) if w]
        return torch.logsumexp(torch.tensor(terms), 0).item() if terms else 0.0

    def candidate_source(self, passage: int | None) -> str:
        """The trace source of a candidate's tokens: its passage's role, ``pure`` without."""
        return FROM_PURE if passage is None else passage_role(passage)
