"""One logit-lens product for the queries of a batch (the LM head read once per step).

A rule that lenses hidden states at every step where its contexts disagree (Tok-RAG's l*
search, Eq. 13-14) names the rows of its first product (:meth:`..policies.base.Policy.first_lens_rows`).
At a step of a batched decode, :func:`choose_many` takes the choices the rule makes without
its signals (:meth:`..policies.base.Policy.choice_without_signals`), then lenses the rows of
every query left in one product and hands each query its part as ``views["rag"].lens_first``;
the rule reads them instead of computing the same product itself. The choices are those the
rule makes for each query on its own.
"""

from __future__ import annotations

import torch

from ..attention import logit_lens, model_parts
from ..models import LoadedModel
from ..policies.base import Choice, Policy, View

__all__ = ["choose_many"]


def choose_many(policy: Policy, views: list[dict[str, View]], lm: LoadedModel) -> list[Choice]:
    """``policy.choose`` for every query of one step (``views``, one dict per query, in
    order): the choices the rule makes without its signals first, then the first logit-lens
    rows of the queries left lensed together, then the rule's choices for those."""
    decided: dict[int, Choice] = {}
    for i, v in enumerate(views):
        gated = policy.choice_without_signals(v)
        if gated is not None:
            decided[i] = gated
    left = [i for i in range(len(views)) if i not in decided]
    need = []
    for i in left:
        rows = policy.first_lens_rows(views[i])
        if rows is not None:
            need.append((views[i], rows))
    if len(need) > 1:
        stacked = torch.cat([rows for _, rows in need])
        lensed = logit_lens(model_parts(lm.model), stacked, final_norm=policy.lens_norm)
        logp = torch.log_softmax(lensed, dim=-1)
        parts = logp.split([rows.shape[0] for _, rows in need])
        for (v, _), part in zip(need, parts, strict=True):
            v["rag"].lens_first = part
    decided.update(zip(left, policy.choose_many([views[i] for i in left], lm), strict=True))
    return [decided[i] for i in range(len(views))]
