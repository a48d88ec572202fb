"""Device rule of :class:`...policies.rag_token.RAGToken`: next token argmax_y Σ_z p(z|x)·
p(y|x, z) over the ``passage:j`` contexts (K slots, weight 0 where a query has fewer), the
source ``passage:j`` of argmax_j p(z_j|x)·p(y|x, z_j), the signals ``p_mix`` and
``p_passage``, and the citation p(z|x, y) (:func:`...policies.rag_token.passage_posterior`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...policies.rag_token import RAGToken, passage_role
from ..step_types import StepTensors
from .common import Layout, RecordRule, passage_priors, role_rows, source_codes


class RAGTokenRule(RecordRule):
    def __init__(self, policy: RAGToken, lm: Any, *, citations: bool | None, passages: int):
        self.K = int(passages)
        roles = [passage_role(j) for j in range(self.K)]
        self.sources = source_codes(roles)
        super().__init__(
            lm, roles, cite=None if citations is False else "posterior", passages=self.K
        )

    def add_signals(self, layout: Layout) -> None:
        layout.add("p_mix")
        layout.add("n")
        layout.add("p_passage", self.K)

    def choose(
        self, t: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        Q = t.num_queries
        beyond = [r for r in t.rows if r.startswith("passage:") and int(r.split(":")[1]) >= self.K]
        if beyond:  # the role names are the step's layout, not tensor values
            raise ValueError(
                f"this rag_token device rule has {self.K} passage slots but the step has "
                f"{beyond[0]!r}: build it with device_rule_for(..., passages=) the largest count"
            )
        probs, present = [], []
        for j in range(self.K):
            rows, there = role_rows(t, passage_role(j), Q)
            probs.append(torch.softmax(t.logits.index_select(0, rows).float(), dim=-1))
            present.append(there)
        pk = torch.stack(probs, dim=1)  # [Q, K, V]
        there = torch.stack(present, dim=1)  # [Q, K]
        w = passage_priors(t, self.K) * there.float()
        mixed = (w[:, None, :] @ pk)[:, 0]  # [Q, V]
        tid = torch.argmax(mixed, dim=-1)
        per = pk.gather(2, tid[:, None, None].expand(Q, self.K, 1))[..., 0] * there.float()
        score = torch.where(there, w * per, float("-inf"))
        best = torch.argmax(score, dim=-1)
        return (
            tid,
            4 + best,
            {
                "p_mix": mixed.gather(1, tid[:, None])[:, 0],
                "n": there.long().sum(-1),
                "p_passage": per,
            },
            torch.log(mixed),  # the mixture's log-probabilities
        )

    def signals_of(self, row: Sequence[float], tokenizer: Any) -> dict[str, Any]:
        lay = self.layout
        n = int(lay.one(row, "n"))
        return {
            "p_mix": lay.one(row, "p_mix"),
            "p_passage": [round(float(x), 4) for x in lay.get(row, "p_passage")[:n]],
        }


def build(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> RAGTokenRule | None:
    if type(policy) is not RAGToken:
        return None
    policy.prepare(lm)
    return RAGTokenRule(policy, lm, citations=citations, passages=passages)
