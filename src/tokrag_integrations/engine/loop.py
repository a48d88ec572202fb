"""The loops on the :class:`.decoder.Decoder`: a decode from start to end
(:func:`decode_loop`), teacher forcing (:func:`teacher_force`), and the loop of a
sequence-level rule (RAG-Sequence, :class:`..policies.base.SequencePolicy`): each query's
candidates greedy-decoded (``rule.candidate_plans`` under ``rule.candidate_policy``; a query
without passages once under ``rule.fallback_policy``), every distinct candidate scored under
every context of ``rule.contexts`` by teacher forcing (with its EOS where it ended with one),
``rule.log_p`` picks one, which is replayed token by token (step 0 of the trace carries every
candidate and its log-scores, ``signals[rule.name]``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..models import LoadedModel
from ..policies.base import Policy, SequencePolicy
from ..prompts import PromptPlan
from ..trace import TraceStep
from .decoder import Decoder, StepEvent, views_for
from .prefill import plain_prefill
from .speed import Speed, speed_of
from .view import ContextView

__all__ = ["decode_loop", "teacher_force"]


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
) -> Iterator[StepEvent]:
    """Greedy multi-context decoding of a batch of queries under one policy, step by step.

    Yields one :class:`.decoder.StepEvent` per chosen token as soon as it is chosen (the
    final event of a query has ``finished=True`` and its ``stop_reason``: ``eos``, ``stop``
    or ``length``). EOS tokens end a query and are not yielded as text. ``speed``: the
    :class:`.speed.Speed` of the decode. A sequence-level rule is decoded as the module
    docstring says.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    timings = timings if timings is not None else {}
    if isinstance(policy, SequencePolicy):
        yield from _decode_sequence(
            lm, plans, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings, speed=speed_of(speed)
        )
        return
    d = Decoder(lm, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings, speed=speed)
    d.admit(plans)
    t1 = time.perf_counter()
    while d.active:
        yield from d.choose()
        d.advance()
    timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1


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


def _candidates(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    rule: SequencePolicy,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    timings: dict[str, float],
    speed: Speed,
) -> list[list[dict[str, Any]]]:
    """Step 1: every query's distinct greedy answers ({"ids", "from_passage", "stop_reason"})."""
    eos = set(lm.eos_token_ids)
    sub_plans: list[PromptPlan] = []
    owner: list[tuple[int, int]] = []
    for q, p in enumerate(plans):
        for j, sub in enumerate(rule.candidate_plans(p)):
            sub_plans.append(sub)
            owner.append((q, j))
    gen: dict[int, list[int]] = {i: [] for i in range(len(sub_plans))}
    reason: dict[int, str] = {}
    if sub_plans:
        events = decode_loop(
            lm, sub_plans, rule.candidate_policy, max_new_tokens=max_new_tokens, stop=stop,
            timings=timings, speed=speed,
        )
        for ev in events:
            if ev.step.token_id not in eos:
                gen[ev.query_idx].append(ev.step.token_id)
            if ev.finished:
                reason[ev.query_idx] = ev.stop_reason
    cands: list[list[dict[str, Any]]] = [[] for _ in plans]
    for i, (q, j) in enumerate(owner):
        if not any(c["ids"] == gen[i] for c in cands[q]):
            cands[q].append({"ids": gen[i], "from_passage": j, "stop_reason": reason.get(i, "length")})
    no_passage = [q for q, p in enumerate(plans) if not p.passage_spans]
    if no_passage:
        out: dict[int, list[int]] = {q: [] for q in no_passage}
        why: dict[int, str] = {}
        events = decode_loop(
            lm,
            [plans[q] for q in no_passage],
            rule.fallback_policy,
            max_new_tokens=max_new_tokens,
            stop=stop,
            timings=timings,
            speed=speed,
        )
        for ev in events:
            q = no_passage[ev.query_idx]
            if ev.step.token_id not in eos:
                out[q].append(ev.step.token_id)
            if ev.finished:
                why[q] = ev.stop_reason
        for q in no_passage:
            cands[q].append({"ids": out[q], "from_passage": None, "stop_reason": why.get(q, "length")})
    return cands


def _cross_scores(
    lm: LoadedModel, plans: Sequence[PromptPlan], rule: SequencePolicy, cands: list[list[dict[str, Any]]]
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
            for role, v in views.items():
                lp = float(torch.log_softmax(v.logits.float(), dim=-1)[y].item())
                logp[(q, c)][role] = logp[(q, c)].get(role, 0.0) + lp
    return logp


def _replay(
    lm: LoadedModel, q: int, rule: SequencePolicy, cands: list[dict[str, Any]], best: int
) -> Iterator[StepEvent]:
    """Step 3's events: the chosen candidate token by token, the summary on step 0."""
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
    for i, tid in enumerate(steps):
        is_eos = tid in eos
        step = TraceStep(
            index=i,
            token_id=tid,
            text="" if is_eos else tok.decode([tid]),
            source=source,
            signals={rule.name: summary} if i == 0 else {},
        )
        last = i == len(steps) - 1
        reason = ("eos" if is_eos else chosen["stop_reason"]) if last else ""
        yield StepEvent(q, step, finished=last, stop_reason=reason)


def _decode_sequence(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    rule: SequencePolicy,
    *,
    max_new_tokens: int,
    stop: Sequence[str],
    timings: dict[str, float],
    speed: Speed,
) -> Iterator[StepEvent]:
    """Decode ``plans`` under the sequence-level ``rule`` (the module docstring);
    ``timings`` gets the candidates' decode times and ``score_s``, the cross-scoring's."""
    cands = _candidates(lm, plans, rule, max_new_tokens=max_new_tokens, stop=stop, timings=timings, speed=speed)
    t0 = time.perf_counter()
    logp = _cross_scores(lm, plans, rule, cands)
    timings["score_s"] = timings.get("score_s", 0.0) + time.perf_counter() - t0
    for q, p in enumerate(plans):
        contexts = rule.contexts(p)
        for c, cand in enumerate(cands[q]):
            per = [logp.get((q, c), {}).get(role, 0.0) for role in contexts]
            cand["log_p_passages"] = [round(x, 4) for x in per]
            cand["log_p"] = rule.log_p([s.weight for s in contexts.values()], per)
        best = max(range(len(cands[q])), key=lambda c: cands[q][c]["log_p"])
        yield from _replay(lm, q, rule, cands[q], best)
