"""What structured output hands the engine (:class:`TokenConstraint`: a token mask per step,
in llguidance's bitmask layout) and the bitmask's reading (:func:`allowed_from_bitmask`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["MASKED_LOGIT", "TokenConstraint", "allowed_from_bitmask", "bitmask_words"]

#: What a token the constraint forbids gets in the contexts' logits before the rule runs: a
#: finite number, so that a rule's arithmetic on logits (CAD's (1 + α)·z_RAG − α·z_LLM) stays
#: finite, far below any real logit, so that its probability is exactly 0 in float32.
MASKED_LOGIT = -1e30


def bitmask_words(vocab: int) -> int:
    """int32 words per row of a token bitmask over ``vocab`` tokens."""
    return (int(vocab) + 31) // 32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, ceil(V/32)] int32 (bit j of word i allows token 32·i + j) -> [N, V] bool."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@runtime_checkable
class TokenConstraint(Protocol):
    """A token mask per step (structured output; ``tokrag_integrations.structured``)."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of an int32 [N, ceil(V/32)]
        bitmask (bit j of word i allows token 32·i + j)."""
        ...

    def accept(self, token_id: int) -> None:
        """The chosen token (raises if it is not allowed)."""
        ...

    def is_finished(self) -> bool:
        """The grammar is complete: the query stops."""
        ...

    def fork(self) -> TokenConstraint:
        """A fresh copy at the start (one per query of ``n > 1``)."""
        ...
