"""Citation scores from the model's own attention (issue 46): at a generated step, how much
the generating position of the RAG context attends to each passage.

score_j = Σ_{t ∈ span_j} ā(t) / Σ_k Σ_{t ∈ span_k} ā(t), where ā is the attention row of the
position that predicts the token, averaged over heads and over the layers read
(:func:`citation_layers`). The layers read were chosen on dev (``benchmarks/citations.py``;
docs/results.md, "Citations").
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


def passage_scores(attn: torch.Tensor, spans: list[torch.Tensor]) -> list[float]:
    """Each passage's share of the attention on all passages.

    Args:
        attn: [..., H, T] attention probabilities of the generating position (one layer
            [H, T] or several [n, H, T]); averaged over every leading dimension.
        spans: per passage, its positions in the coordinates of ``attn``'s last dimension.

    Returns:
        One score per passage, summing to 1 (uniform where the passages get no attention).
    """
    if not spans:
        return []
    row = attn.reshape(-1, attn.shape[-1]).float().mean(0)
    mass = torch.stack([row.index_select(0, pos).sum() for pos in spans])
    total = float(mass.sum())
    if not total > 0:
        return [1.0 / len(spans)] * len(spans)
    return (mass / total).tolist()
