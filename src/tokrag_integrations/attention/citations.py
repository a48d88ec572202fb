"""Citation scores from the model's own attention (issue 46): at a generated step, which
passage the generating position of the RAG context drew the token from.

Copy vote: over the heads (l, h) of the layers read (:func:`citation_layers`), C is the set
whose attention argmax lands on a passage position holding the generated token w (the
"retrieval heads" test of Wu et al. 2024, arXiv 2404.15574, applied per step, so no head
table is needed: it holds on any model). score_j = |{(l, h) ∈ C : argmax ∈ span_j}| / |C|.
Where C is empty (w is not copied, or no head attends to it), the attention mass:
score_j = Σ_{t ∈ span_j} ā(t) / Σ_k Σ_{t ∈ span_k} ā(t), ā averaged over those heads and
layers. Chosen on dev (``benchmarks/citations.py``; docs/results.md, "Citations").
"""

from __future__ import annotations

import torch

__all__ = ["LAYER_CHOICES", "citation_layers", "passage_scores"]

#: The layer sets :func:`citation_layers` knows (0-based indices into L layers).
LAYER_CHOICES = ("last", "last4", "upper", "upper-middle", "all")
#: The default, chosen by ``benchmarks/citations.py`` (docs/results.md, "Citations").
DEFAULT_LAYERS = "upper-middle"


def citation_layers(num_layers: int, choice: str = DEFAULT_LAYERS) -> list[int]:
    """The 0-based layers whose attention a citation averages: ``"last"`` (layer L),
    ``"last4"`` (the last four), ``"upper"`` (L/2+1 .. L), ``"upper-middle"`` (0.6·L+1 ..
    0.8·L: layers 19-24 of SmolLM2's 30) or ``"all"``."""
    if choice == "last":
        return [num_layers - 1]
    if choice == "last4":
        return list(range(max(0, num_layers - 4), num_layers))
    if choice == "upper":
        return list(range(num_layers // 2, num_layers))
    if choice == "upper-middle":  # at least one layer, for models of a few layers
        low = int(0.6 * num_layers)
        return list(range(low, max(int(0.8 * num_layers), low + 1)))
    if choice == "all":
        return list(range(num_layers))
    raise ValueError(f"unknown citation layers {choice!r}; one of {', '.join(LAYER_CHOICES)}")


def passage_scores(
    attn: torch.Tensor,
    spans: list[torch.Tensor],
    ids: list[torch.Tensor] | None = None,
    token: int | None = None,
) -> list[float]:
    """Each passage's share of the copying heads' votes, else of the attention on all passages.

    Args:
        attn: [..., H, T] attention probabilities of the generating position (one layer
            [H, T] or several [n, H, T]), over the whole context.
        spans: per passage, its positions in the coordinates of ``attn``'s last dimension
            (ascending, passage after passage, as in the prompt).
        ids: per passage, the token ids at those positions; with ``token`` (the generated
            token) the copy vote is taken, else only the attention mass.

    Returns:
        One score per passage, summing to 1 (uniform where the passages get no attention).
    """
    if not spans:
        return []
    rows = attn.reshape(-1, attn.shape[-1]).float()
    pos = torch.cat(spans)
    if ids is not None and token is not None and len(pos):
        top = rows.argmax(-1)  # each head's argmax position
        tok = torch.cat(ids)
        at = torch.searchsorted(pos, top).clamp_max(len(pos) - 1)  # positions are ascending
        copied = (pos[at] == top) & (tok[at] == token)
        if bool(copied.any()):
            ends = torch.tensor([len(p) for p in spans], device=pos.device).cumsum(0)
            votes = torch.bincount(
                torch.searchsorted(ends, at[copied], right=True), minlength=len(spans)
            )
            return (votes.float() / votes.sum()).tolist()
    row = rows.mean(0)
    mass = torch.stack([row.index_select(0, p).sum() for p in spans])
    total = float(mass.sum())
    if not total > 0:
        return [1.0 / len(spans)] * len(spans)
    return (mass / total).tolist()
