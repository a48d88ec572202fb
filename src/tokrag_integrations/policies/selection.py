"""Token-level selection baselines (seed 000, Table 3 / Appendix I.3): ``logprob`` and ``entropy``.

Both decode the pure and the RAG context in parallel like Tok-RAG and, where their top-1
tokens differ, keep the candidate of the context that looks more certain: the higher top-1
log-probability (Kuhn et al., 2023) or the lower entropy (Malinin & Gales, 2020; for one
token the length-normalised entropy is the entropy itself). The margins are also the
scores of the token-level benefit/detriment classification (> 0 means "RAG wins").
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..trace import AGREE, FROM_PURE, FROM_RAG
from . import signals as S
from .base import Choice, Lens, Policy, View


def logprob_margin(pure_probs: torch.Tensor, rag_probs: torch.Tensor) -> float:
    """log max p_RAG − log max p_LLM (shapes [V]); >= 0 keeps the RAG token."""
    return float(torch.log(rag_probs.max()).item() - torch.log(pure_probs.max()).item())


def entropy_margin(pure_probs: torch.Tensor, rag_probs: torch.Tensor) -> float:
    """H(p_LLM) − H(p_RAG) in nats (shapes [V]); >= 0 keeps the RAG token."""
    return float(S.entropy(pure_probs).item() - S.entropy(rag_probs).item())


class _MarginSelection(Policy):
    roles = ("pure", "rag")
    #: ``margin(pure_probs, rag_probs)``: >= 0 keeps the RAG token.
    margin: Callable[[torch.Tensor, torch.Tensor], float]

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        return [self._one(v["pure"], v["rag"]) for v in views]

    def _one(self, pure: View, rag: View) -> Choice:
        a = int(torch.argmax(pure.logits).item())
        b = int(torch.argmax(rag.logits).item())
        if a == b:
            return Choice(a, AGREE, logits=rag.logits)
        m = self.margin(pure.probs, rag.probs)
        if m >= 0:  # the token and its distribution from the context kept
            return Choice(b, FROM_RAG, {"margin": m}, logits=rag.logits)
        return Choice(a, FROM_PURE, {"margin": m}, logits=pure.logits)


class LogprobSelection(_MarginSelection):
    """Keep the candidate whose top-1 log-probability is higher (ties keep RAG)."""

    name = "logprob"
    margin = staticmethod(logprob_margin)


class EntropySelection(_MarginSelection):
    """Keep the candidate whose context's next-token entropy is lower (ties keep RAG)."""

    name = "entropy"
    margin = staticmethod(entropy_margin)
