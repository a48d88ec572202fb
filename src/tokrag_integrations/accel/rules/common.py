"""What every device rule shares: the record layout, the rows of a role, the logit lens, and
the trace parts the engine's ``step_event`` writes (each role's top-1 candidate, the
statistics of :func:`...engine.stats.distribution_stats_rows`, and the citation scores of
:func:`...attention.citations.passage_scores`, the copy vote else the attention mass), all
on tensors of fixed shape with no host read and no branch on a tensor's value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...attention.citations import citation_layers
from ...attention.parts import ModelParts, model_parts
from ...sampling import MAX_TOP_LOGPROBS, draw, logprobs
from ...trace import Candidate, TopLogprob
from ..step_types import DecodedStep, StepTensors

#: The statistics of a role, in the order of :func:`...engine.stats.distribution_stats_rows`.
STAT_NAMES = ("logp", "entropy", "gini", "mean_logp")
#: Floats per role in the record: present, top-1 id, its probability, the statistics.
ROLE_WIDTH = 3 + len(STAT_NAMES)


class Layout:
    """Named float slots of a record row (built once per rule; the rule writes its pieces in
    the order they were added, :meth:`pack`)."""

    def __init__(self) -> None:
        self.slots: dict[str, slice] = {}
        self.width = 0

    def add(self, name: str, n: int = 1) -> None:
        self.slots[name] = slice(self.width, self.width + n)
        self.width += n

    def pack(self, pieces: dict[str, torch.Tensor]) -> torch.Tensor:
        """One [Q, width] float32 record from ``pieces`` (name -> [Q] or [Q, n]), which must
        name every slot, in the order of :meth:`add`."""
        cols = []
        for name, sl in self.slots.items():
            x = pieces[name].float()
            cols.append(x.reshape(x.shape[0], sl.stop - sl.start))
        return torch.cat(cols, dim=1)

    def get(self, row: Sequence[float], name: str) -> list[float]:
        return list(row[self.slots[name]])

    def one(self, row: Sequence[float], name: str) -> float:
        return float(row[self.slots[name].start])


def split_double(x: torch.Tensor) -> torch.Tensor:
    """A float64 [Q] as two float32 [Q, 2] (hi, lo) whose sum gives it back to ~48 bits (a
    margin the policy computes in Python floats)."""
    hi = x.float()
    lo = (x - hi.double()).float()
    return torch.stack([hi, lo], dim=1)


def join_double(pair: Sequence[float]) -> float:
    return float(pair[0]) + float(pair[1])


def role_rows(t: StepTensors, role: str, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``role`` ([Q] long, clamped to a valid row) and whether each query has
    that context ([Q] bool); a role the step does not name is absent everywhere."""
    rows = t.rows.get(role)
    if rows is None:
        zero = torch.zeros(q, dtype=torch.long, device=t.logits.device)
        return zero, torch.zeros(q, dtype=torch.bool, device=t.logits.device)
    return rows.clamp_min(0), rows >= 0


def role_logits(t: StepTensors, role: str) -> torch.Tensor:
    """[Q, V] float32 next-token logits of each query's ``role`` context (row 0's where the
    query has none: read :func:`role_rows`' mask)."""
    rows, _ = role_rows(t, role, t.num_queries)
    return t.logits.index_select(0, rows).float()


def lens(parts: ModelParts, h: torch.Tensor, final_norm: bool) -> torch.Tensor:
    """:func:`...attention.rows.logit_lens` without the CPU product hook (one ``F.linear``
    of every row): [..., d] -> [..., V] float32."""
    h = h.to(parts.lm_head.weight.dtype)
    if final_norm:
        h = parts.final_norm(h)
    logits = parts.lm_head(h).float()
    if parts.logits_scaling:
        logits = logits / parts.logits_scaling
    cap = parts.final_logit_softcap
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim, the first index among equal maxima (as ``torch.argmax``)."""
    return torch.argmax(x, dim=-1)


class TraceParts:
    """The trace parts of ``step_event`` for ``roles`` and the citation scores, computed
    after the choice (:meth:`compute`) and read back (:meth:`decode_into`); ``num_layers``:
    the model's depth L (the citation layers of :func:`citation_layers`).

    Citations (``cite="attention"``): over the heads of :func:`citation_layers`' layers of
    the ``rag`` row, the copy vote where some head's argmax is a retrieved column holding the
    chosen token, else each passage's share of the heads' mean attention (uniform where
    none); ``cite="posterior"``: RAG-Token's p(z|x, y) ∝ p(z|x)·p(y|x, z) over the
    ``passage:j`` roles; None: no citation."""

    def __init__(
        self,
        num_layers: int,
        roles: Sequence[str],
        layout: Layout,
        *,
        cite: str | None,
        passages: int,
    ):
        self.roles, self.cite, self.K = tuple(roles), cite, int(passages)
        for role in self.roles:
            layout.add(f"role:{role}", ROLE_WIDTH)
        if cite is not None:
            layout.add("cite_n")
            layout.add("cite", self.K)
        if cite == "attention":
            layers = citation_layers(num_layers)
            self.cite_layers = slice(layers[0], layers[-1] + 1)
        self.layout = layout

    def compute(self, t: StepTensors, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Record pieces of every role and the citation, for the chosen ``ids`` [Q]."""
        Q = t.num_queries
        out: dict[str, torch.Tensor] = {}
        for role in self.roles:
            rows, present = role_rows(t, role, Q)
            logp = torch.log_softmax(t.logits.index_select(0, rows).float(), dim=-1)
            p = logp.exp()
            clamped = logp.clamp(min=-1e4)
            top = first_argmax(p)
            out[f"role:{role}"] = torch.stack(
                [
                    present.float(),
                    top.float(),
                    p.gather(1, top[:, None])[:, 0],
                    logp.gather(1, ids[:, None])[:, 0],
                    -(p * clamped).sum(-1),
                    (p * p).sum(-1),
                    clamped.mean(-1),
                ],
                dim=1,
            )
        if self.cite == "attention":
            out["cite_n"], out["cite"] = self._attention_citation(t, ids)
        elif self.cite == "posterior":
            out["cite_n"], out["cite"] = self._posterior_citation(t, ids)
        return out

    def _attention_citation(
        self, t: StepTensors, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        Q, K, dev = t.num_queries, self.K, t.logits.device
        n = (
            torch.full((Q,), -1, dtype=torch.long, device=dev)
            if t.cite_passages is None or t.attn is None
            else t.cite_passages.to(dev)
        )
        n = torch.where(n <= K, n, -1)  # more passages than slots: not cited here
        if t.attn is None:
            return n.float(), torch.zeros(Q, K, device=dev)
        rows, _ = role_rows(t, "rag", Q)
        a = t.attn.index_select(0, rows)[:, self.cite_layers].float()  # [Q, n, H, T]
        a = a.reshape(Q, -1, a.shape[-1])  # [Q, heads, T]
        top = first_argmax(a)  # [Q, heads]
        valid = t.rt_valid & (t.rt_passage < K)
        slot = t.rt_passage.clamp(0, K - 1)
        slots_k = torch.arange(K, device=dev)
        onehot = ((slot[..., None] == slots_k) & valid[..., None]).float()  # [Q, P, K]
        copied = (t.rt_pos[:, None, :] == top[:, :, None]) & (t.rt_ids == ids[:, None])[:, None, :]
        per_slot = copied.float().sum(1) * valid.float()  # [Q, P]: heads copying from each slot
        votes = (per_slot[:, :, None] * onehot).sum(1)  # [Q, K]
        vote_total = votes.sum(-1, keepdim=True)
        mean = a.mean(1)  # [Q, T]
        at = mean.gather(1, t.rt_pos) * valid.float()  # [Q, P]
        mass = (at[:, :, None] * onehot).sum(1)  # [Q, K]
        total = mass.sum(-1, keepdim=True)
        slots = torch.arange(K, device=dev)[None, :] < n[:, None]
        uniform = slots.float() / n.clamp_min(1)[:, None].float()
        by_mass = torch.where(total > 0, mass / torch.where(total > 0, total, 1.0), uniform)
        by_vote = votes / vote_total.clamp_min(1.0)
        score = torch.where(vote_total > 0, by_vote, by_mass)
        return n.float(), torch.where(slots, score, 0.0)

    def _posterior_citation(
        self, t: StepTensors, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        Q, dev = t.num_queries, t.logits.device
        per, present = passage_token_probs(t, ids, self.K)
        w = passage_priors(t, self.K)
        mass = (w.double() * per.double()) * present.double()
        total = mass.sum(-1, keepdim=True)
        n = present.long().sum(-1)
        uniform = present.double() / n.clamp_min(1)[:, None].double()
        score = torch.where(total > 0, mass / torch.where(total > 0, total, 1.0), uniform)
        del Q, dev
        return n.float(), score.float()

    def decode_into(self, row: Sequence[float], tokenizer: Any, out: DecodedStep) -> None:
        """Fill ``out``'s candidates, stats and citation from a record row."""
        lay = self.layout
        for role in self.roles:
            vals = lay.get(row, f"role:{role}")
            if vals[0] < 0.5:
                continue
            top = int(vals[1])
            out.candidates[role] = Candidate(top, tokenizer.decode([top]), float(vals[2]))
            out.stats[role] = dict(zip(STAT_NAMES, (float(x) for x in vals[3:]), strict=True))
        if self.cite is not None:
            n = int(lay.one(row, "cite_n"))
            out.citation = lay.get(row, "cite")[:n] if n > 0 else []


def passage_token_probs(
    t: StepTensors, ids: torch.Tensor, K: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """p(y|x, z_j) of the chosen ``ids`` under each ``passage:j`` context, [Q, K] (0 where
    absent), and which passages each query has, [Q, K] bool."""
    Q = t.num_queries
    per, present = [], []
    for j in range(K):
        rows, there = role_rows(t, f"passage:{j}", Q)
        probs = torch.softmax(t.logits.index_select(0, rows).float(), dim=-1)
        per.append(probs.gather(1, ids[:, None])[:, 0] * there.float())
        present.append(there)
    return torch.stack(per, dim=1), torch.stack(present, dim=1)


def passage_priors(t: StepTensors, K: int) -> torch.Tensor:
    """p(z|x) [Q, K] float32 (0 where a query has no such passage)."""
    Q = t.num_queries
    if t.weights is None:
        return torch.zeros(Q, K, device=t.logits.device)
    w = t.weights.float()
    if w.shape[1] >= K:
        return w[:, :K]
    return torch.nn.functional.pad(w, (0, K - w.shape[1]))


def source_codes(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The source labels a record's ``source`` slot indexes."""
    from ...policies.cad import MIX
    from ...trace import AGREE, FROM_PURE, FROM_RAG

    return (AGREE, FROM_RAG, FROM_PURE, MIX, *extra)


class RecordRule:
    """A device rule's frame: the record starts with the chosen token, its source code and
    its log-probabilities, then the rule's own signal slots (:meth:`add_signals`), then the
    trace parts; a subclass writes :meth:`choose` (ids [Q], source codes [Q], signal pieces,
    the decision logits [Q, V]: the distribution each token was taken from, as the policy's
    ``Choice.logits``) and :meth:`signals_of` (the signals dict from a record row).

    Sampling (issue 57): where ``t.sampling`` is given, the token is drawn from the decision
    logits (masked by ``t.allowed``) by :func:`...sampling.draw`, the rule's own token kept
    where the temperature is 0; the trace parts are computed for the token drawn."""

    #: The source labels the ``source`` slot indexes (a subclass may add its own).
    sources: tuple[str, ...] = source_codes()

    def __init__(
        self,
        lm: Any,
        roles: Sequence[str],
        *,
        cite: str | None,
        passages: int,
    ) -> None:
        self.layout = Layout()
        self.layout.add("token")
        self.layout.add("source")
        self.layout.add("logprob")
        self.layout.add("top_ids", MAX_TOP_LOGPROBS)
        self.layout.add("top_lp", MAX_TOP_LOGPROBS)
        self.add_signals(self.layout)
        layers = model_parts(lm.model).num_layers if cite == "attention" else 0
        self.parts = TraceParts(layers, roles, self.layout, cite=cite, passages=passages)
        self.record_width = self.layout.width
        #: The passage slots: a query with more passages is not cited (its citation is []),
        #: so the engine builds the rule for the largest count it admits.
        self.passages = int(passages)

    def add_signals(self, layout: Layout) -> None:
        """Add the rule's signal slots (none by default)."""

    def choose(
        self, t: StepTensors
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def signals_of(self, row: Sequence[float], tokenizer: Any) -> dict[str, Any]:
        return {}

    def __call__(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, source, pieces, logits = self.choose(t)
        logits = logits.float()
        if t.allowed is not None:
            logits = logits.masked_fill(~t.allowed, float("-inf"))
        s = t.sampling
        if s is not None:
            drawn = draw(logits, s.temperature, s.top_p, s.top_k, s.seed, s.step)
            ids = torch.where(s.temperature > 0, drawn, ids)
        lp, top_ids, top_lp = logprobs(logits, ids, MAX_TOP_LOGPROBS)
        pieces = {
            **pieces,
            "token": ids,
            "source": source,
            "logprob": lp,
            "top_ids": top_ids,
            "top_lp": top_lp,
            **self.parts.compute(t, ids),
        }
        return ids, self.layout.pack(pieces), logits

    def decode(
        self, record_row: Sequence[float], tokenizer: Any, top_logprobs: int = MAX_TOP_LOGPROBS
    ) -> DecodedStep:
        row = [float(x) for x in record_row]
        out = DecodedStep(
            int(self.layout.one(row, "token")),
            self.sources[int(self.layout.one(row, "source"))],
            self.signals_of(row, tokenizer),
        )
        self.parts.decode_into(row, tokenizer, out)
        out.logprob = self.layout.one(row, "logprob")
        out.top_logprobs = [
            TopLogprob(int(i), tokenizer.decode([int(i)]), float(x))
            for i, x in zip(
                self.layout.get(row, "top_ids")[:top_logprobs],
                self.layout.get(row, "top_lp")[:top_logprobs],
                strict=True,
            )
        ]
        return out


def attention_cite(roles: Sequence[str], citations: bool | None) -> str | None:
    """The citation kind of a rule with these roles: the attention scores where it has a
    ``rag`` context and citations are not off."""
    return "attention" if "rag" in roles and citations is not False else None


#: Source codes of :func:`source_codes`.
AGREE_CODE, RAG_CODE, LLM_CODE, MIX_CODE = 0, 1, 2, 3


def code(x: int, like: torch.Tensor) -> torch.Tensor:
    """A constant source code as a tensor of ``like``'s shape."""
    return torch.full_like(like, x, dtype=torch.long)
