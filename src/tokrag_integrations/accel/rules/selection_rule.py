"""Device rules of :mod:`...policies.selection`: ``logprob`` (log max p_RAG − log max p_LLM)
and ``entropy`` (H(p_LLM) − H(p_RAG), in float64 as :func:`...policies.signals.entropy`);
where the top-1 tokens differ, RAG's is kept iff the margin is >= 0. The margin is a Python
float in the policy's signals: the record carries it as two float32 (hi, lo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...policies.selection import EntropySelection, LogprobSelection
from ..step_types import StepTensors
from .common import (
    AGREE_CODE,
    LLM_CODE,
    RAG_CODE,
    Layout,
    RecordRule,
    attention_cite,
    join_double,
    role_logits,
    split_double,
)


def entropy_rows(probs: torch.Tensor) -> torch.Tensor:
    """:func:`...policies.signals.entropy` over the last dim (float64)."""
    p = probs.double()
    return -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)


class MarginRule(RecordRule):
    def __init__(self, policy: Any, lm: Any, *, citations: bool | None, passages: int):
        self.kind = "entropy" if type(policy) is EntropySelection else "logprob"
        super().__init__(
            lm, policy.roles, cite=attention_cite(policy.roles, citations), passages=passages
        )

    def add_signals(self, layout: Layout) -> None:
        layout.add("margin", 2)

    def choose(
        self, t: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        pure, rag = role_logits(t, "pure"), role_logits(t, "rag")
        a, b = torch.argmax(pure, dim=-1), torch.argmax(rag, dim=-1)
        p_pure, p_rag = torch.softmax(pure, dim=-1), torch.softmax(rag, dim=-1)
        if self.kind == "entropy":
            m = entropy_rows(p_pure) - entropy_rows(p_rag)
        else:
            m = torch.log(p_rag.amax(-1)).double() - torch.log(p_pure.amax(-1)).double()
        agree = a == b
        keep_rag = agree | (m >= 0)
        ids = torch.where(keep_rag, b, a)
        source = torch.where(agree, AGREE_CODE, torch.where(keep_rag, RAG_CODE, LLM_CODE))
        # The chosen source's distribution (``agree``: RAG's).
        logits = torch.where((source == LLM_CODE)[:, None], pure, rag)
        return ids, source, {"margin": split_double(m)}, logits

    def signals_of(self, row: Sequence[float], tokenizer: Any) -> dict[str, Any]:
        if self.sources[int(self.layout.one(row, "source"))] == self.sources[AGREE_CODE]:
            return {}
        return {"margin": join_double(self.layout.get(row, "margin"))}


def build(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> MarginRule | None:
    if type(policy) not in (LogprobSelection, EntropySelection):
        return None
    policy.prepare(lm)
    return MarginRule(policy, lm, citations=citations, passages=passages)
