"""Single-source baselines: the pure LLM, standard RAG, and the two-context cost floor."""

from __future__ import annotations

import torch

from ..trace import AGREE, FROM_PURE, FROM_RAG
from .base import Choice, Lens, Policy, View


class NoRAG(Policy):
    """Retrieval ignored: greedy decoding of the pure context (``model.generate`` equivalent)."""

    name = "no_rag"
    roles = ("pure",)

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        # The token is argmax z_pure, from the pure context's distribution.
        return [
            Choice(int(torch.argmax(v["pure"].logits).item()), FROM_PURE, logits=v["pure"].logits)
            for v in views
        ]


class StandardRAG(Policy):
    """Standard RAG: greedy decoding of the RAG context."""

    name = "rag"
    roles = ("rag",)

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        # The token is argmax z_RAG, from the RAG context's distribution.
        return [
            Choice(int(torch.argmax(v["rag"].logits).item()), FROM_RAG, logits=v["rag"].logits)
            for v in views
        ]


class TwoContextFloor(Policy):
    """Both contexts decoded, no signals; emits the RAG token. The cost floor of Tok-RAG
    (docs/algorithm.md, "Cost"): what any two-context method pays before computing a single signal."""

    name = "floor"
    roles = ("pure", "rag")

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        out = []
        for v in views:
            a, b = (
                int(torch.argmax(v["pure"].logits).item()),
                int(torch.argmax(v["rag"].logits).item()),
            )
            out.append(Choice(b, AGREE if a == b else FROM_RAG, logits=v["rag"].logits))
        return out
