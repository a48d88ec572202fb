"""Device rules of :mod:`...policies.cad`: ``cad`` (argmax of (1 + α)·logits_RAG −
α·logits_LLM with a fixed α) and ``adacad`` (α = JSD(p_RAG, p_LLM) per query, Eq. of
:func:`...policies.signals.jsd`); the source is ``agree`` / ``rag`` / ``pure`` / ``mix`` as
:func:`...policies.cad._source` gives it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...policies import signals as S
from ...policies.cad import CAD, AdaCAD, contrast_logits
from ..step_types import StepTensors
from .common import (
    AGREE_CODE,
    LLM_CODE,
    MIX_CODE,
    RAG_CODE,
    Layout,
    RecordRule,
    attention_cite,
    role_logits,
)


class CADRule(RecordRule):
    """CAD / AdaCAD on the device."""

    def __init__(self, policy: CAD, lm: Any, *, citations: bool | None, passages: int):
        self.p, self.adaptive = policy, type(policy) is AdaCAD
        super().__init__(
            lm, policy.roles, cite=attention_cite(policy.roles, citations), passages=passages
        )

    def add_signals(self, layout: Layout) -> None:
        layout.add("alpha")

    def choose(
        self, t: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        pure, rag = role_logits(t, "pure"), role_logits(t, "rag")
        a, b = torch.argmax(pure, dim=-1), torch.argmax(rag, dim=-1)
        if self.adaptive:
            alpha = S.jsd(torch.softmax(rag, dim=-1), torch.softmax(pure, dim=-1))  # [Q]
            contrast = contrast_logits(rag, pure, alpha[:, None])
        else:
            alpha = torch.full_like(rag[:, 0], self.p.alpha)
            contrast = contrast_logits(rag, pure, self.p.alpha)
        tid = torch.argmax(contrast, dim=-1)
        source = torch.where(
            (a == b) & (tid == b),
            AGREE_CODE,
            torch.where(tid == b, RAG_CODE, torch.where(tid == a, LLM_CODE, MIX_CODE)),
        )
        return tid, source, {"alpha": alpha}, contrast

    def signals_of(self, row: Sequence[float], tokenizer: Any) -> dict[str, Any]:
        return {"alpha": self.layout.one(row, "alpha") if self.adaptive else self.p.alpha}


def build(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> CADRule | None:
    if type(policy) not in (CAD, AdaCAD):
        return None
    policy.prepare(lm)
    return CADRule(policy, lm, citations=citations, passages=passages)
