"""Per-step statistics of a next-token distribution (the trace's ``stats`` and the
confidence metrics)."""

from __future__ import annotations

import torch


def distribution_stats(logits: torch.Tensor, token_id: int) -> dict[str, float]:
    """Per-step summary of one next-token distribution, O(V), for the confidence metrics.

    ``logits`` [V] -> ``{"logp": log p(y), "entropy": -sum p log p, "gini": sum p^2,
    "mean_logp": (1/V) sum_v log p(v)}`` (float). DP (exp entropy) and Self-Certainty
    (-log V - mean_logp) are derived from these (Confident RAG, Eq. 2-6). ``mean_logp``
    uses log-probabilities clamped at -1e4 so a masked (-inf) logit cannot make it -inf.
    """
    return distribution_stats_rows(logits[None], token_id)[0][0]


def distribution_stats_rows(
    logits: torch.Tensor, token_id: int
) -> tuple[list[dict[str, float]], torch.Tensor]:
    """:func:`distribution_stats` of several distributions at once (``logits`` [N, V]); also
    returns their probabilities [N, V] (the exponentials the statistics are made of)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    clamped = logp.clamp(min=-1e4)
    vals = torch.stack(
        [
            logp[:, int(token_id)],
            -(p * clamped).sum(-1),
            (p * p).sum(-1),
            clamped.mean(-1),
        ],
        dim=1,
    ).tolist()
    names = ("logp", "entropy", "gini", "mean_logp")
    return [dict(zip(names, row, strict=True)) for row in vals], p
