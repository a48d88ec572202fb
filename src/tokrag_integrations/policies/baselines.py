"""Single-source baselines: the pure LLM, standard RAG, and the two-context cost floor."""

from __future__ import annotations

import torch

from ..models import LoadedModel
from ..trace import FROM_LLM, FROM_RAG
from .base import Choice, Policy, View


class PureLLM(Policy):
    """Retrieval ignored: greedy decoding of the pure context (``model.generate`` equivalent)."""

    name = "llm"
    roles = ("pure",)
    uses_passages = False

    def choose(self, views: dict[str, View], lm: LoadedModel) -> Choice:
        return Choice(int(torch.argmax(views["pure"].logits).item()), FROM_LLM)


class StandardRAG(Policy):
    """Standard RAG: greedy decoding of the RAG context."""

    name = "rag"
    roles = ("rag",)

    def choose(self, views: dict[str, View], lm: LoadedModel) -> Choice:
        return Choice(int(torch.argmax(views["rag"].logits).item()), FROM_RAG)


class TwoContextFloor(Policy):
    """Both contexts decoded, no signals; emits the RAG token. The cost floor of Tok-RAG
    (docs/algorithm.md, "Cost"): what any two-context method pays before computing a single signal."""

    name = "floor"
    roles = ("pure", "rag")

    def choose(self, views: dict[str, View], lm: LoadedModel) -> Choice:
        a = int(torch.argmax(views["pure"].logits).item())
        b = int(torch.argmax(views["rag"].logits).item())
        return Choice(b, "agree" if a == b else FROM_RAG)
