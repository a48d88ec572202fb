"""Device rules of :mod:`...policies.baselines`: ``no_rag`` (argmax of the pure context),
``rag`` (argmax of the RAG context) and ``floor`` (RAG's token; ``agree`` where the pure
context's argmax is the same)."""

from __future__ import annotations

from typing import Any

import torch

from ...policies.baselines import NoRAG, StandardRAG, TwoContextFloor
from ..step_types import StepTensors
from .common import AGREE_CODE, LLM_CODE, RAG_CODE, RecordRule, attention_cite, code, role_logits


class NoRAGRule(RecordRule):
    """``no_rag``: argmax_v logits_pure."""

    def choose(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        z = role_logits(t, "pure")
        ids = torch.argmax(z, dim=-1)
        return ids, code(LLM_CODE, ids), {}, z


class StandardRAGRule(RecordRule):
    """``rag``: argmax_v logits_RAG."""

    def choose(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        z = role_logits(t, "rag")
        ids = torch.argmax(z, dim=-1)
        return ids, code(RAG_CODE, ids), {}, z


class FloorRule(RecordRule):
    """``floor``: b = argmax logits_RAG, source ``agree`` where a = argmax logits_pure = b."""

    def choose(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        a = torch.argmax(role_logits(t, "pure"), dim=-1)
        rag = role_logits(t, "rag")
        b = torch.argmax(rag, dim=-1)
        return b, torch.where(a == b, AGREE_CODE, RAG_CODE), {}, rag


_RULES: dict[type, type[RecordRule]] = {
    NoRAG: NoRAGRule,
    StandardRAG: StandardRAGRule,
    TwoContextFloor: FloorRule,
}


def build(policy: Any, lm: Any, *, citations: bool | None, passages: int) -> RecordRule | None:
    rule = _RULES.get(type(policy))
    if rule is None:
        return None
    policy.prepare(lm)
    roles = policy.roles
    return rule(lm, roles, cite=attention_cite(roles, citations), passages=passages)
