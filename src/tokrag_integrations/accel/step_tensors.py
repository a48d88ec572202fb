"""The contract between the static decode state and the device rules (issue 56, item 3).

At every step of ``speed="cuda"`` the captured step hands the policy's :class:`DeviceRule`
one :class:`StepTensors`: every row's next-token logits and (for the probed rows) the
per-layer states a rule reads, in tensors of fixed shape. The rule computes the policy's
equations branch-free on the device and returns the chosen ids and one float32 record per
query; the host reads both once, after the step, and :meth:`DeviceRule.decode` turns a
record row into what the policy's own ``choose`` and the engine's ``step_event`` would have
written (:class:`DecodedStep`).

:func:`device_rule_for` gives a policy's rule (None where it has none: the engine decodes
that policy on the view path). :func:`step_tensors_from_views` builds a
:class:`StepTensors` from the view path's :class:`..engine.view.ContextView` objects, so
that every rule is checked against its policy on real model states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .step_types import MAX_PASSAGES, DecodedStep, DeviceRule, StepTensors

__all__ = [
    "MAX_PASSAGES",
    "DecodedStep",
    "DeviceRule",
    "StepTensors",
    "device_rule_for",
    "step_tensors_from_views",
]


def device_rule_for(
    policy: Any, lm: Any, *, citations: bool | None, passages: int = MAX_PASSAGES
) -> DeviceRule | None:
    """The device rule of ``policy`` on ``lm`` (its ``prepare`` is called), or None where the
    policy (or this combination of its options) has none: the engine then decodes it on the
    view path. ``citations``: as the Decoder's (False: no citation scores are computed);
    ``passages``: the citation (and RAG-Token passage) slots of the record."""
    from .rules import rule_for  # the rules import the policy modules

    return rule_for(policy, lm, citations=citations, passages=passages)


def step_tensors_from_views(
    views_per_query: Sequence[Mapping[str, Any]],
    cite_lengths: Sequence[Sequence[int] | None] | None = None,
    *,
    weights: bool | None = None,
    attention: bool = True,
) -> StepTensors:
    """A :class:`StepTensors` of one step of the view path (a test bridge): one row per
    view, in query then role order; ``resid`` / ``attn`` from the probed views (zeros for
    the others, attention right-padded to the longest row); ``rt_*`` from each query's
    ``rag`` view. ``cite_lengths``: per query, its passages' token counts where the engine
    cites it (the Decoder's ``_cite``), else None; ``weights``: the passage priors of
    ``passage:j`` views (default: where any view has a weight). ``attention=False`` leaves
    ``attn`` None (no attention rows recomputed)."""
    logits: list[torch.Tensor] = []
    resid: list[torch.Tensor | None] = []
    attn: list[torch.Tensor | None] = []
    roles: dict[str, list[int]] = {}
    rt: list[tuple[list[int], list[int], list[int]]] = []
    nq = len(views_per_query)
    for q, views in enumerate(views_per_query):
        for role, v in views.items():
            roles.setdefault(role, [-1] * nq)[q] = len(logits)
            logits.append(v.logits.float())
            rec = v.record
            resid.append(None if rec is None else rec.resid[:, 0].float())
            attn.append(v.attention_all().float() if attention and rec is not None else None)
        rag = views.get("rag")
        if rag is None:
            rt.append(([], [], []))
            continue
        pos = [int(p) for p in rag.rt_positions.tolist()]
        ids = [int(i) for i in rag.rt_token_ids.tolist()]
        lengths = None if cite_lengths is None else cite_lengths[q]
        if lengths is None:
            lengths = [len(pos)]
        passage = [j for j, n in enumerate(lengths) for _ in range(n)]
        if len(passage) != len(pos):  # spans that are not the retrieved positions
            passage = [0] * len(pos)
        rt.append((pos, ids, passage))
    dev = logits[0].device
    P = max(1, max(len(p) for p, _, _ in rt))

    def pad(rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor([r + [0] * (P - len(r)) for r in rows], dtype=torch.long, device=dev)

    rt_pos = pad([p for p, _, _ in rt])
    rt_ids = pad([i for _, i, _ in rt])
    rt_passage = pad([j for _, _, j in rt])
    rt_valid = torch.tensor(
        [[k < len(p) for k in range(P)] for p, _, _ in rt], dtype=torch.bool, device=dev
    )
    out_resid = None
    if any(r is not None for r in resid):
        shape = next(r for r in resid if r is not None).shape
        out_resid = torch.stack([torch.zeros(shape, device=dev) if r is None else r for r in resid])
    out_attn = None
    if any(a is not None for a in attn):
        first = next(a for a in attn if a is not None)
        T = max(a.shape[-1] for a in attn if a is not None)
        out_attn = torch.zeros((len(attn), *first.shape[:-1], T), device=dev)
        for r, a in enumerate(attn):
            if a is not None:
                out_attn[r, ..., : a.shape[-1]] = a
    rows = {role: torch.tensor(r, dtype=torch.long, device=dev) for role, r in roles.items()}
    passage_roles = sorted(
        (r for r in roles if r.startswith("passage:")), key=lambda r: int(r.split(":")[1])
    )
    w = None
    if weights or (
        weights is None
        and any(
            getattr(v.spec, "weight", None) is not None
            for vs in views_per_query
            for v in vs.values()
        )
    ):
        K = max(1, len(passage_roles))
        w = torch.zeros((nq, K), device=dev)
        for q, views in enumerate(views_per_query):
            for j, role in enumerate(passage_roles):
                if role in views and views[role].spec.weight is not None:
                    w[q, j] = float(views[role].spec.weight)
    cite = None
    if cite_lengths is not None and any(c is not None for c in cite_lengths):
        cite = torch.tensor([-1 if c is None else len(c) for c in cite_lengths], device=dev)
    return StepTensors(
        logits=torch.stack(logits),
        resid=out_resid,
        attn=out_attn,
        rows=rows,
        rt_pos=rt_pos,
        rt_ids=rt_ids,
        rt_valid=rt_valid,
        rt_passage=rt_passage,
        weights=w,
        cite_passages=cite,
    )
