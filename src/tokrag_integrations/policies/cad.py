"""Context-aware decoding: ``cad`` (Shi et al., 2023) and ``adacad`` (Wang et al., 2024).

CAD contrasts the RAG context with the pure one: next token = argmax of
(1 + α)·logits_RAG − α·logits_LLM, which amplifies what the passages add. AdaCAD sets α per
step to JSD(p_RAG, p_LLM), so the contrast is strong only where the passages conflict with
the model's own belief. α = 0 is standard RAG exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..trace import AGREE, FROM_PURE, FROM_RAG
from . import signals as S
from .base import Choice, Lens, Policy, View

#: Source label of a token that neither context's top-1 proposes on its own.
MIX = "mix"


def contrast_logits(
    rag_logits: torch.Tensor, pure_logits: torch.Tensor, alpha: float | torch.Tensor
) -> torch.Tensor:
    """(1 + α)·logits_RAG − α·logits_LLM (shapes [..., V])."""
    return (1 + alpha) * rag_logits.float() - alpha * pure_logits.float()


def _source(tid: int, a: int, b: int) -> str:
    if a == b == tid:
        return AGREE
    if tid == b:
        return FROM_RAG
    if tid == a:
        return FROM_PURE
    return MIX


#: Largest α of :class:`CAD`: far beyond any useful contrast, far below where
#: ``(1 + α)·logits`` overflows float32 (inf - inf = NaN at every token).
MAX_ALPHA = 1000.0


class CAD(Policy):
    """Context-aware decoding with a fixed α.

    Args:
        alpha: contrast strength, in [0, :data:`MAX_ALPHA`] (0 = standard RAG; the CAD paper
            uses 0.5).
    """

    name = "cad"
    roles = ("pure", "rag")

    def __init__(self, alpha: float = 0.5):
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha >= 0:
            raise ValueError(f"alpha must be a number >= 0 (0 = standard RAG), got {alpha!r}")
        if not alpha <= MAX_ALPHA:
            raise ValueError(
                f"alpha must be at most {MAX_ALPHA:g} (the CAD paper uses 0.5; a larger alpha "
                f"overflows the contrasted logits), got {alpha!r}"
            )
        self.alpha = float(alpha)

    def options(self) -> dict[str, Any]:
        return {"alpha": self.alpha}

    def step_alpha(self, pure: View, rag: View) -> float:
        return self.alpha

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        out = []
        for v in views:
            pure, rag = v["pure"], v["rag"]
            a, b = int(torch.argmax(pure.logits).item()), int(torch.argmax(rag.logits).item())
            alpha = self.step_alpha(pure, rag)
            contrast = contrast_logits(rag.logits, pure.logits, alpha)
            tid = int(torch.argmax(contrast).item())
            out.append(Choice(tid, _source(tid, a, b), {"alpha": alpha}, logits=contrast))
        return out


class AdaCAD(CAD):
    """CAD with α = JSD(p_RAG, p_LLM) at every step (in nats, so α ∈ [0, ln 2])."""

    name = "adacad"

    def __init__(self) -> None:
        super().__init__(alpha=0.0)

    def options(self) -> dict[str, Any]:
        return {"alpha": "jsd"}

    def step_alpha(self, pure: View, rag: View) -> float:
        return float(S.jsd(rag.probs, pure.probs).item())
