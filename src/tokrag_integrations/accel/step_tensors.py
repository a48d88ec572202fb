"""The contract between the static decode state and the device rules (issue 56, item 3).

At every step of ``speed="cuda"`` the captured step hands the policy's :class:`DeviceRule`
one :class:`StepTensors`: every row's next-token logits and (for the probed rows) the
per-layer states a rule reads, in tensors of fixed shape. The rule computes the policy's
equations branch-free on the device and returns the chosen ids and one float32 record per
query; the host reads both once, after the step, and :meth:`DeviceRule.decode` turns a
record row into what the policy's own ``choose`` and the engine's ``step_event`` would have
written (:class:`DecodedStep`).

:func:`.rules.device_rule_for` gives a policy's rule (None where it has none: the engine decodes
that policy on the view path). :func:`step_tensors_from_views` builds a
:class:`StepTensors` from the view path's :class:`..engine.view.ContextView` objects, so
that every rule is checked against its policy on real model states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..trace import Candidate

__all__ = [
    "MAX_PASSAGES",
    "DecodedStep",
    "DeviceRule",
    "StepTensors",
    "step_tensors_from_views",
]

#: The citation slots of a record by default: a query with more passages than the rule was
#: built for is not cited on the device (build the rule with ``passages=`` its count).
MAX_PASSAGES = 16


@dataclass
class StepTensors:
    """One step of Q queries over R rows (R >= the rows in use; a row no query names is
    ignored). Shapes: V the vocabulary, L the layers, H the heads, d the hidden size, T the
    cache columns, P the retrieved-token slots, K the passage slots."""

    #: [R, V] float32: next-token logits of every row.
    logits: torch.Tensor
    #: [R, L+1, d]: the residual stream at the last position (layer 0 = the embeddings, as
    #: :attr:`..attention.probe.ProbeRecord.resid`); None where no rule reads it.
    resid: torch.Tensor | None
    #: [R, L, H, T]: attention probabilities of the last position at every layer over the T
    #: cache columns (0 where masked); None where no rule reads it.
    attn: torch.Tensor | None
    #: role -> [Q] long: the row of each query's context of that role (``"pure"``, ``"rag"``,
    #: ``"passage:0"``...); -1 where the query has no such context.
    rows: dict[str, torch.Tensor]
    #: [Q, P] long: the ``rag`` context's retrieved-token columns (cache coordinates of its
    #: row), right-padded with 0.
    rt_pos: torch.Tensor
    #: [Q, P] long: the token ids at those columns (pad 0).
    rt_ids: torch.Tensor
    #: [Q, P] bool: which slots hold a retrieved token.
    rt_valid: torch.Tensor
    #: [Q, P] long: the passage index (0-based) of each retrieved token (pad 0).
    rt_passage: torch.Tensor
    #: [Q, K] float: each passage context's prior p(z|x) (``rag_token``; 0 where absent),
    #: else None.
    weights: torch.Tensor | None = None
    #: [Q] long: how many passages each query's citation scores cover (-1: the query is not
    #: cited; 0: cited, with no passage, its citation is []); None: no query is cited. A
    #: query is cited where the engine cites it today (the Decoder's ``_cite``: its ``rag``
    #: context is probed and holds exactly its passages). RAG-Token's citation (every
    #: context a passage) does not read it.
    cite_passages: torch.Tensor | None = None

    @property
    def num_queries(self) -> int:
        return int(self.rt_pos.shape[0])


@dataclass
class DecodedStep:
    """What the host rebuilds from one record row: the policy's Choice (``token_id``,
    ``source``, ``signals`` exactly as its ``choose`` writes them), and the trace parts of
    the engine's ``step_event`` (each role's top-1 ``candidates``, ``stats`` of
    :func:`..engine.stats.distribution_stats_rows`, the ``citation`` scores or None)."""

    token_id: int
    source: str
    signals: dict[str, Any] = field(default_factory=dict)
    candidates: dict[str, Candidate] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    citation: list[float] = field(default_factory=list)


@runtime_checkable
class DeviceRule(Protocol):
    """A policy's rule on the device, built once per decode by :func:`.rules.device_rule_for`."""

    #: Floats per query in the record.
    record_width: int

    def __call__(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (ids [Q] long, record [Q, record_width] float32): the chosen tokens and
        everything the trace needs (source code, each role's top-1 candidate and its
        probability, the statistics, the signals, the citation scores), computed on the
        device without a host read and without a branch on a tensor's value."""
        ...

    def decode(self, record_row: Sequence[float], tokenizer: Any) -> DecodedStep:
        """Host side, after the one read: one query's :class:`DecodedStep`."""
        ...




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
