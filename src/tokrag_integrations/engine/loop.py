"""Teacher forcing (:func:`teacher_force`) and a sequence-level rule (RAG-Sequence,
:class:`..policies.base.SequencePolicy`) as a :class:`SequenceDecoder` the scheduler steps
like any other decoder, on :class:`.decoder.Decoder` requests made inside the scheduler's
steps: each query's candidates greedy-decoded (``rule.candidate_plans`` under
``rule.candidate_policy``; a query without passages once under ``rule.fallback_policy``),
every distinct candidate scored under every context of ``rule.contexts`` by teacher forcing
(its tokens given, with its EOS where it ended with one), ``rule.log_p`` picks one, which is
replayed token by token (step 0 of the trace carries every candidate and its log-scores,
``signals[rule.name]``).

Sampling (issue 57): each candidate is decoded by ``rule.candidate_policy`` with the query's
sampling (greedy, or sampled with a seed of its own derived from the query's and the
candidate's index) and the query's constraint (a fork per candidate); the scoring is teacher
forced, so unchanged; the answer's tokens carry the log-probabilities of the candidate decode
that made them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..models import LoadedModel
from ..policies.base import Policy, SequencePolicy
from ..policies.rag_token import passage_posterior
from ..prompts import PromptPlan
from ..speed import Speed
from ..trace import TraceStep
from .decoder import Decoder, StepEvent
from .sampler import GREEDY, QuerySampling
from .view import ContextView

__all__ = ["SequenceDecoder", "decoder_for", "teacher_force"]


def teacher_force(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    targets: Sequence[Sequence[int]],
    speed: Speed | str | Mapping[str, Any] | None = None,
) -> Iterator[tuple[int, int, dict[str, ContextView]]]:
    """Walk every query's contexts along a fixed continuation (teacher forcing).

    The queries are admitted to a :class:`.decoder.Decoder` with their tokens given
    (``forced=``): at each step, instead of letting ``policy`` choose, token
    ``targets[q][i]`` is fed to all contexts of query ``q`` after step ``i``. Yields
    ``(query_idx, i, views)`` where the views' logits predict ``targets[q][i]``; consume the
    views before advancing the iterator (the next step overwrites them). Used for
    gold-continuation scoring (token-level AUC); RAG-Sequence's cross-scoring makes the same
    requests inside the scheduler's steps (:class:`SequenceDecoder`).
    """
    if len(plans) != len(targets):
        raise ValueError(f"got {len(plans)} plans but {len(targets)} target sequences")
    given = [(q, list(t)) for q, t in enumerate(targets) if len(t)]
    if not given:
        return
    d = Decoder(lm, policy, max_new_tokens=max(len(t) for _, t in given), speed=speed)
    ids = d.admit([plans[q] for q, _ in given], forced=[t for _, t in given])
    owner = dict(zip(ids, (q for q, _ in given), strict=True))
    while d.active:
        for ev in d.choose():
            assert ev.views is not None
            yield owner[ev.query_idx], ev.step.index, ev.views
        d.advance()


def decoder_for(
    lm: LoadedModel,
    policy: Policy,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    speed: Speed,
    citations: bool | None = False,
    room: Callable[[], int | None] | None = None,
) -> Decoder | SequenceDecoder:
    """The decoder of ``policy``'s queries: a :class:`SequenceDecoder` for a sequence-level
    rule (``room``: the context rows it may still take, None: no bound), else a
    :class:`.decoder.Decoder`."""
    if isinstance(policy, SequencePolicy):
        return SequenceDecoder(
            lm,
            policy,
            max_new_tokens=max_new_tokens,
            stop=stop,
            speed=speed,
            citations=citations,
            room=room,
        )
    return Decoder(
        lm, policy, max_new_tokens=max_new_tokens, stop=stop, speed=speed, citations=citations
    )


class _Query:
    """One query of a :class:`SequenceDecoder`: its plan, its candidates as they are decoded
    and scored, and once chosen, the replayed answer's events."""

    def __init__(
        self, plan: PromptPlan, subs: list[PromptPlan], fallback: bool, sampling: QuerySampling
    ) -> None:
        self.plan = plan
        self.sampling = sampling
        self.subs = subs  # candidate prompts; the fallback's plan last where it has one
        self.fallback = fallback
        self.answers: dict[int, tuple[list[int], str]] = {}  # sub -> (ids, stop reason)
        self.logprobs: dict[int, list[TraceStep]] = {}  # sub -> its steps (log-probabilities)
        self.cands: list[dict[str, Any]] = []
        self.logp: dict[int, dict[str, float]] = {}
        self.scoring = 0  # teacher-forced rows still running
        self.events: list[StepEvent] = []


class SequenceDecoder:
    """The queries of a sequence-level ``rule`` with a :class:`.decoder.Decoder`'s interface,
    decoded by requests on inner :class:`.decoder.Decoder` s inside the scheduler's steps (the
    module docstring): at each step every inner decoder chooses and advances once, so a
    candidate or a scoring row is one more context row of the step; they are admitted at step
    boundaries while ``room()`` rows are free (at least one request when none runs). A query
    gives no event until its answer is chosen, then one token a step."""

    def __init__(
        self,
        lm: LoadedModel,
        rule: SequencePolicy,
        *,
        max_new_tokens: int,
        stop: Sequence[str],
        speed: Speed,
        citations: bool | None = False,
        room: Callable[[], int | None] | None = None,
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
        self.room = room or (lambda: None)
        self.timings: dict[str, float] = {}
        self.done: list[bool] = []
        self._queries: dict[int, _Query] = {}
        #: Requests not admitted yet: (decoder name, query, item, plan, forced tokens).
        self._waiting: list[tuple[str, int, int, PromptPlan, list[int] | None]] = []
        self._inner: dict[str, Decoder] = {}
        #: Inner decoder name -> inner query id -> (query, item: a sub-plan or a candidate).
        self._owner: dict[str, dict[int, tuple[int, int]]] = {}

    @property
    def active(self) -> list[int]:
        return [q for q, d in enumerate(self.done) if not d]

    def rows_in_use(self) -> int:
        return sum(d.rows_in_use() for d in self._inner.values())

    def width(self) -> int:
        return max((d.width() for d in self._inner.values()), default=0)

    def admit(
        self, plans: Sequence[PromptPlan], sampling: Sequence[QuerySampling] | None = None
    ) -> list[int]:
        rule = self.rule
        rule.prepare(self.lm)
        ids = list(range(len(self.done), len(self.done) + len(plans)))
        smp = list(sampling) if sampling is not None else [GREEDY] * len(plans)
        for q, p, s in zip(ids, plans, smp, strict=True):
            subs = list(rule.candidate_plans(p))
            fallback = not p.passage_spans
            self._queries[q] = _Query(p, subs + ([p] if fallback else []), fallback, s)
            for j, sub in enumerate(subs):
                self._waiting.append(("candidates", q, j, sub, None))
            if fallback:
                self._waiting.append(("fallback", q, len(subs), p, None))
        self.done += [False] * len(plans)
        return ids

    def cancel(self, q: int) -> None:
        self.done[q] = True
        self._queries.pop(q, None)
        self._waiting = [w for w in self._waiting if w[1] != q]
        for name, owners in self._owner.items():
            for i, (owner, _) in list(owners.items()):
                if owner == q:
                    self._inner[name].cancel(i)
                    del owners[i]

    # ------------------------------------------------------------------ one step
    def choose(self) -> list[StepEvent]:
        self._admit_waiting()
        for name, d in list(self._inner.items()):
            if d.active:
                for ev in d.choose():
                    self._take(name, ev)
        out = []
        for q in self.active:
            query = self._queries[q]
            if query.events:
                ev = query.events.pop(0)
                ev.query_idx = q
                self.done[q] = ev.finished
                if ev.finished:
                    del self._queries[q]
                out.append(ev)
        return out

    def advance(self) -> None:
        for d in self._inner.values():
            d.advance()

    def _decoder(self, name: str) -> Decoder:
        if name not in self._inner:
            policy = {
                "candidates": self.rule.candidate_policy,
                "fallback": self.rule.fallback_policy,
                "scoring": self.rule,
            }[name]
            self._inner[name] = Decoder(
                self.lm, policy, max_new_tokens=self.max_new_tokens, stop=self.stop, speed=self.speed
            )
            self._owner[name] = {}
        return self._inner[name]

    def _rows(self, name: str, plan: PromptPlan) -> int:
        policy = self._decoder(name).policy
        policy.prepare(self.lm)
        return len(policy.contexts(plan))

    def _admit_waiting(self) -> None:
        """Admit the waiting requests that fit ``room()``, in order (at least one where no
        request runs); each decoder's in one admission."""
        room = self.room()
        held = self.rows_in_use()
        take: dict[str, list[tuple[int, int, PromptPlan, list[int] | None]]] = {}
        left = []
        for name, q, item, plan, forced in self._waiting:
            rows = self._rows(name, plan)
            if left or (room is not None and held > 0 and rows > room):
                left.append((name, q, item, plan, forced))
                continue
            take.setdefault(name, []).append((q, item, plan, forced))
            held += rows
            room = None if room is None else room - rows
        self._waiting = left
        for name, reqs in take.items():
            d = self._decoder(name)
            forced = [f for *_, f in reqs] if name == "scoring" else None
            smp = None if forced else [self._candidate_sampling(q, item) for q, item, _, _ in reqs]
            ids = d.admit([p for _, _, p, _ in reqs], forced=forced, sampling=smp)  # type: ignore[misc]
            for i, (q, item, _, _) in zip(ids, reqs, strict=True):
                self._owner[name][i] = (q, item)

    def _candidate_sampling(self, q: int, item: int) -> QuerySampling:
        """Candidate ``item`` of query ``q``: the query's sampling with a seed of its own
        (seed + item·2^32, so that two candidates draw apart), a fork of its constraint."""
        s = self._queries[q].sampling
        smp = s.sampling
        if smp.seed is not None:
            smp = dataclasses.replace(smp, seed=(smp.seed + (item << 32)) & ((1 << 63) - 1))
        return QuerySampling(smp, s.constraint.fork() if s.constraint is not None else None)

    def _take(self, name: str, ev: StepEvent) -> None:
        """One inner event: a candidate's token, or a scoring row's step."""
        owner = self._owner[name]
        q, item = owner[ev.query_idx]
        if ev.finished:
            del owner[ev.query_idx]
        query = self._queries.get(q)
        if query is None:
            return
        if name == "scoring":
            self._score(q, query, item, ev)
            return
        ids, _ = query.answers.get(item, ([], ""))
        if ev.step.token_id not in self.lm.eos_token_ids:
            ids.append(ev.step.token_id)
            query.logprobs.setdefault(item, []).append(ev.step)
        query.answers[item] = (ids, ev.stop_reason if ev.finished else "")
        if len(query.answers) == len(query.subs) and all(r for _, r in query.answers.values()):
            self._candidates_done(q, query)

    def _candidates_done(self, q: int, query: _Query) -> None:
        """Step 1 done for ``query``: its distinct candidates; their scoring requests."""
        eos = self.lm.eos_token_ids[0]
        n_subs = len(query.subs) - int(query.fallback)
        for j in range(len(query.subs)):
            ids, reason = query.answers[j]
            passage = None if j >= n_subs else j
            if passage is not None and any(c["ids"] == ids for c in query.cands):
                continue  # a passage's answer already given by another: one candidate
            query.cands.append(
                {
                    "ids": ids,
                    "from_passage": passage,
                    "stop_reason": reason,
                    "steps": query.logprobs.get(j, []),
                }
            )
        for c, cd in enumerate(query.cands):
            cd["target"] = cd["ids"] + ([eos] if cd["stop_reason"] == "eos" else [])
            query.logp[c] = {}
            if query.plan.passage_spans and cd["target"]:
                self._waiting.append(("scoring", q, c, query.plan, cd["target"]))
                query.scoring += 1
        if not query.scoring:
            self._choose_answer(q, query)

    def _score(self, q: int, query: _Query, c: int, ev: StepEvent) -> None:
        """Step 2: one teacher-forced token of candidate ``c`` under every context."""
        cd = query.cands[c]
        i = ev.step.index
        y = cd["target"][i]
        token_p = cd.setdefault("token_p", {}).setdefault(i, {})
        for role, v in (ev.views or {}).items():
            lp = float(torch.log_softmax(v.logits.float(), dim=-1)[y].item())
            query.logp[c][role] = query.logp[c].get(role, 0.0) + lp
            token_p[role] = math.exp(lp)
        if ev.finished:
            query.scoring -= 1
            if not query.scoring:
                self._choose_answer(q, query)

    def _choose_answer(self, q: int, query: _Query) -> None:
        """Step 3: every candidate's score, the best one replayed."""
        rule = self.rule
        contexts = rule.contexts(query.plan)
        cands = query.cands
        for c, cand in enumerate(cands):
            per = [query.logp.get(c, {}).get(role, 0.0) for role in contexts]
            cand["log_p_passages"] = [round(x, 4) for x in per]
            cand["log_p"] = rule.log_p([s.weight for s in contexts.values()], per)
        best = max(range(len(cands)), key=lambda c: cands[c]["log_p"])
        weights = (
            {r: spec.weight or 0.0 for r, spec in contexts.items()} if self.citations else None
        )
        query.events = _replay(self.lm, q, rule, cands, best, weights)


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
        made = chosen.get("steps", [])
        if i < len(made):  # the candidate decode's log-probabilities
            step.logprob, step.top_logprobs = made[i].logprob, made[i].top_logprobs
        token_p = chosen.get("token_p", {}).get(i)
        if weights and token_p:
            step.citation = passage_posterior(list(weights.values()), [token_p[r] for r in weights])
        last = i == len(steps) - 1
        reason = ("eos" if is_eos else chosen["stop_reason"]) if last else ""
        events.append(StepEvent(q, step, finished=last, stop_reason=reason))
    return events
