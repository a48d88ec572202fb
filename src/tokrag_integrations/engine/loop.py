"""The loops on the :class:`.decoder.Decoder`: a decode from start to end
(:func:`decode_loop`), teacher forcing (:func:`teacher_force`), and a sequence-level rule
(RAG-Sequence, :class:`..policies.base.SequencePolicy`) as a :class:`SequenceDecoder` the
scheduler steps like any other: each query's candidates greedy-decoded
(``rule.candidate_plans`` under ``rule.candidate_policy``; a query without passages once under
``rule.fallback_policy``), every distinct candidate scored under every context of
``rule.contexts`` by teacher forcing (with its EOS where it ended with one), ``rule.log_p``
picks one, which is replayed token by token (step 0 of the trace carries every candidate and
its log-scores, ``signals[rule.name]``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..contexts.prefill import plain_prefill
from ..models import LoadedModel
from ..policies.base import Policy, SequencePolicy
from ..policies.rag_token import passage_posterior
from ..prompts import PromptPlan
from ..speed import Speed
from ..trace import TraceStep
from .decoder import Decoder, StepEvent, views_for
from .view import ContextView

__all__ = ["SequenceDecoder", "decode_loop", "decoder_for", "teacher_force"]


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    speed: Speed | str | Mapping[str, Any] | None = None,
) -> Iterator[StepEvent]:
    """Greedy multi-context decoding of a batch of queries under one step-level policy.

    Yields one :class:`.decoder.StepEvent` per chosen token as soon as it is chosen (the
    final event of a query has ``finished=True`` and its ``stop_reason``: ``eos``, ``stop``
    or ``length``).
    """
    d = Decoder(lm, policy, max_new_tokens=max_new_tokens, stop=stop, speed=speed)
    d.admit(plans)
    while d.active:
        yield from d.choose()
        d.advance()


def teacher_force(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    targets: Sequence[Sequence[int]],
) -> Iterator[tuple[int, int, dict[str, ContextView]]]:
    """Walk every query's contexts along a fixed continuation (teacher forcing).

    The decoder of :func:`decode_loop` (each role prefilled on its own, no fusion), but
    instead of letting ``policy`` choose, token ``targets[q][i]`` is fed to all contexts of
    query ``q`` after step ``i``. Yields ``(query_idx, i, views)`` where the views' logits
    predict ``targets[q][i]``; consume the views before advancing the iterator (the next
    step overwrites them). Used for gold-continuation scoring (token-level AUC) and
    RAG-Sequence's cross-scoring.
    """
    if len(plans) != len(targets):
        raise ValueError(f"got {len(plans)} plans but {len(targets)} target sequences")
    n_steps = max((len(t) for t in targets), default=0)
    if n_steps == 0:
        return
    with torch.inference_mode():
        d = Decoder(lm, policy, max_new_tokens=n_steps, prefill=plain_prefill)
        d.admit(plans)
        for i in range(n_steps):
            for q in range(len(plans)):
                if i < len(targets[q]):
                    yield q, i, views_for(d.rows, q)
            if i == n_steps - 1:
                break
            d.advance({q: int(t[i]) for q, t in enumerate(targets) if i < len(t)})


def decoder_for(
    lm: LoadedModel,
    policy: Policy,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    speed: Speed,
    citations: bool | None = False,
) -> Decoder | SequenceDecoder:
    """The decoder of ``policy``'s queries: a :class:`SequenceDecoder` for a sequence-level
    rule, else a :class:`.decoder.Decoder`."""
    if isinstance(policy, SequencePolicy):
        return SequenceDecoder(
            lm, policy, max_new_tokens=max_new_tokens, stop=stop, speed=speed, citations=citations
        )
    return Decoder(
        lm, policy, max_new_tokens=max_new_tokens, stop=stop, speed=speed, citations=citations
    )


class SequenceDecoder:
    """The queries of a sequence-level ``rule`` with a :class:`.decoder.Decoder`'s interface.

    The queries admitted since the last step are decoded together (the module docstring) at
    the next :meth:`choose`; each step then gives every active query the next token of its
    chosen candidate. Until then they count the context rows that decode will hold.
    """

    def __init__(
        self,
        lm: LoadedModel,
        rule: SequencePolicy,
        *,
        max_new_tokens: int,
        stop: Sequence[str],
        speed: Speed,
        citations: bool | None = False,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.lm, self.rule = lm, rule
        self.max_new_tokens, self.stop, self.speed = max_new_tokens, stop, speed
        #: Whether the chosen answer's tokens carry each passage's posterior (False: none).
        self.citations = citations is not False
        #: ``Speed.static`` asked for: the candidates are decoded on the static state, the
        #: sequence-level scoring (teacher forcing) on the view path.
        self.static_off = (
            f"policy {rule.name!r} has no device rule: its scoring runs on the view path"
            if speed.wants_static(lm.model.device.type)
            else None
        )
        self.timings: dict[str, float] = {}
        self.done: list[bool] = []
        self._pending: dict[int, tuple[PromptPlan, list[int]]] = {}
        self._events: dict[int, list[StepEvent]] = {}

    @property
    def active(self) -> list[int]:
        return [q for q, d in enumerate(self.done) if not d]

    def rows_in_use(self) -> int:
        return sum(len(n) for _, n in self._pending.values())

    def width(self) -> int:
        return max((max(n) for _, n in self._pending.values() if n), default=0)

    def admit(self, plans: Sequence[PromptPlan]) -> list[int]:
        self.rule.prepare(self.lm)
        ids = list(range(len(self.done), len(self.done) + len(plans)))
        for q, p in zip(ids, plans, strict=True):
            self._pending[q] = (p, [len(c.ids) for c in self.rule.contexts(p).values()])
        self.done += [False] * len(plans)
        return ids

    def cancel(self, q: int) -> None:
        self.done[q] = True
        self._pending.pop(q, None)
        self._events.pop(q, None)

    def choose(self) -> list[StepEvent]:
        if self._pending:
            ids = list(self._pending)
            plans = [self._pending[q][0] for q in ids]
            self._pending.clear()
            with torch.inference_mode():
                for i, events in enumerate(self._decode(plans)):
                    self._events[ids[i]] = events
        out = []
        for q in self.active:
            ev = self._events[q].pop(0)
            ev.query_idx = q
            self.done[q] = ev.finished
            if ev.finished:
                del self._events[q]
            out.append(ev)
        return out

    def advance(self, tokens: dict[int, int] | None = None) -> None:
        """Nothing to feed: the answers are decoded already."""

    def _decode(self, plans: Sequence[PromptPlan]) -> list[list[StepEvent]]:
        """Every query's events: its candidates, their scores, the best one replayed."""
        rule = self.rule
        cands = self._candidates(plans)
        logp = _cross_scores(self.lm, plans, rule, cands)
        out = []
        for q, p in enumerate(plans):
            contexts = rule.contexts(p)
            for c, cand in enumerate(cands[q]):
                per = [logp.get((q, c), {}).get(role, 0.0) for role in contexts]
                cand["log_p_passages"] = [round(x, 4) for x in per]
                cand["log_p"] = rule.log_p([s.weight for s in contexts.values()], per)
            best = max(range(len(cands[q])), key=lambda c: cands[q][c]["log_p"])
            weights = (
                {r: spec.weight or 0.0 for r, spec in contexts.items()} if self.citations else None
            )
            out.append(_replay(self.lm, q, rule, cands[q], best, weights))
        return out

    def _greedy(self, plans: Sequence[PromptPlan], policy: Policy) -> list[tuple[list[int], str]]:
        """Each plan's greedy answer under ``policy``: its tokens (no EOS), its stop reason."""
        eos = set(self.lm.eos_token_ids)
        out: list[tuple[list[int], str]] = [([], "length") for _ in plans]
        if not plans:
            return out
        events = decode_loop(
            self.lm,
            plans,
            policy,
            max_new_tokens=self.max_new_tokens,
            stop=self.stop,
            speed=self.speed,
        )
        for ev in events:
            ids, _ = out[ev.query_idx]
            if ev.step.token_id not in eos:
                ids.append(ev.step.token_id)
            if ev.finished:
                out[ev.query_idx] = (ids, ev.stop_reason)
        return out

    def _candidates(self, plans: Sequence[PromptPlan]) -> list[list[dict[str, Any]]]:
        """Step 1: every query's distinct greedy answers ({"ids", "from_passage", "stop_reason"})."""
        rule = self.rule
        subs = [rule.candidate_plans(p) for p in plans]
        owner = [(q, j) for q, s in enumerate(subs) for j in range(len(s))]
        answers = self._greedy([sub for s in subs for sub in s], rule.candidate_policy)
        cands: list[list[dict[str, Any]]] = [[] for _ in plans]
        for (q, j), (ids, reason) in zip(owner, answers, strict=True):
            if not any(c["ids"] == ids for c in cands[q]):
                cands[q].append({"ids": ids, "from_passage": j, "stop_reason": reason})
        no_passage = [q for q, p in enumerate(plans) if not p.passage_spans]
        fallback = self._greedy([plans[q] for q in no_passage], rule.fallback_policy)
        for q, (ids, reason) in zip(no_passage, fallback, strict=True):
            cands[q].append({"ids": ids, "from_passage": None, "stop_reason": reason})
        return cands


def _cross_scores(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    rule: SequencePolicy,
    cands: list[list[dict[str, Any]]],
) -> dict[tuple[int, int], dict[str, float]]:
    """Step 2: (query, candidate) -> {context role: log p(candidate | context)}."""
    for q in range(len(plans)):
        for cd in cands[q]:
            cd["target"] = cd["ids"] + ([lm.eos_token_ids[0]] if cd["stop_reason"] == "eos" else [])
    rows = [
        (q, c)
        for q in range(len(plans))
        if plans[q].passage_spans
        for c in range(len(cands[q]))
        if cands[q][c]["target"]
    ]
    logp: dict[tuple[int, int], dict[str, float]] = {r: {} for r in rows}
    if rows:
        targets = [cands[q][c]["target"] for q, c in rows]
        for r, i, views in teacher_force(lm, [plans[q] for q, _ in rows], rule, targets):
            q, c = rows[r]
            y = cands[q][c]["target"][i]
            token_p = cands[q][c].setdefault("token_p", {}).setdefault(i, {})
            for role, v in views.items():
                lp = float(torch.log_softmax(v.logits.float(), dim=-1)[y].item())
                logp[(q, c)][role] = logp[(q, c)].get(role, 0.0) + lp
                token_p[role] = math.exp(lp)
    return logp


def _replay(
    lm: LoadedModel,
    q: int,
    rule: SequencePolicy,
    cands: list[dict[str, Any]],
    best: int,
    weights: dict[str, float] | None = None,
) -> list[StepEvent]:
    """Step 3's events: the chosen candidate token by token, the summary on step 0; with
    ``weights`` (p(z|x)), each token cited to the passages by its posterior."""
    tok = lm.tokenizer
    eos = set(lm.eos_token_ids)
    chosen = cands[best]
    summary = [
        {
            "text": tok.decode(cd["ids"], skip_special_tokens=True),
            "from_passage": cd["from_passage"],
            "log_p": round(cd["log_p"], 4),
            "log_p_passages": cd.get("log_p_passages", []),
            "chosen": c == best,
        }
        for c, cd in enumerate(cands)
    ]
    source = rule.candidate_source(chosen["from_passage"])
    ids = chosen["ids"]
    steps = ids + ([lm.eos_token_ids[0]] if chosen["stop_reason"] == "eos" or not ids else [])
    events = []
    for i, tid in enumerate(steps):
        is_eos = tid in eos
        step = TraceStep(
            index=i,
            token_id=tid,
            text="" if is_eos else tok.decode([tid]),
            source=source,
            signals={rule.name: summary} if i == 0 else {},
        )
        token_p = chosen.get("token_p", {}).get(i)
        if weights and token_p:
            step.citation = passage_posterior(list(weights.values()), [token_p[r] for r in weights])
        last = i == len(steps) - 1
        reason = ("eos" if is_eos else chosen["stop_reason"]) if last else ""
        events.append(StepEvent(q, step, finished=last, stop_reason=reason))
    return events
