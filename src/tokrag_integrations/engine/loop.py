"""The multi-context greedy loop.

Every policy (``llm``, ``rag``, ``tokrag``, ``cad``...) is a rule over the same loop: each
query owns one or more *contexts* (the pure prompt, the RAG prompt, one prompt per
passage...), every context keeps its own KV cache, all contexts of a query share the
generated suffix, and at each step the policy turns the contexts' next-token logits into one
token. Contexts of the same role across a batch of queries are left-padded and run as one
batch, so a step costs one forward pass per role. How the contexts are prefilled (and
whether they are fused into one batch) is the ``prefill`` argument: the runner passes the
speed path of :mod:`..accel`; this module never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..models import LoadedModel
from ..policies.base import Choice, ContextSpec, Policy
from ..prompts import PromptPlan
from ..trace import Candidate, TraceStep
from .batch import RoleBatch
from .prefill import Prefilled, plain_prefill, row_map
from .stats import distribution_stats_rows
from .view import ContextView

#: ``prefill(roles, per_query, lm, policy)``: the prefilled batches of a decode.
PrefillFn = Callable[[Sequence[str], Sequence[dict[str, ContextSpec]], LoadedModel, Policy], Prefilled]
#: ``choose_many(policy, views, lm)``: the choices of one step for several queries.
ChooseFn = Callable[[Policy, list[dict[str, ContextView]], LoadedModel], list[Choice]]


@dataclass
class StepEvent:
    """A token chosen for query ``query_idx`` (yielded by :func:`decode_loop`)."""

    query_idx: int
    step: TraceStep
    finished: bool = False
    stop_reason: str = ""


def step_event(
    lm: LoadedModel,
    q: int,
    step_i: int,
    choice: Choice,
    views: dict[str, ContextView],
    generated: list[int],
    stop: Sequence[str],
    max_new_tokens: int,
) -> StepEvent:
    """The trace step of one chosen token and whether it ends the query (``generated`` is
    the query's token list so far; the token is appended unless it is EOS)."""
    tok = lm.tokenizer
    tid = int(choice.token_id)
    is_eos = tid in lm.eos_token_ids
    cands = {}
    stats = {}
    # Every context's statistics in one pass over its logits; its probabilities are kept for
    # the view (a rule that read them already has them).
    rows, probs = distribution_stats_rows(torch.stack([v.logits for v in views.values()]), tid)
    tops = torch.argmax(probs, dim=-1).tolist()
    for i, (role, v) in enumerate(views.items()):
        if v._probs is None:
            v._probs = probs[i]
        top = int(tops[i])
        cands[role] = Candidate(top, tok.decode([top]), float(v.probs[top].item()))
        stats[role] = rows[i]
    step = TraceStep(
        index=step_i,
        token_id=tid,
        text="" if is_eos else tok.decode([tid]),
        source=choice.source,
        candidates=cands,
        signals=choice.signals,
        stats=stats,
    )
    reason = ""
    if is_eos:
        reason = "eos"
    else:
        generated.append(tid)
        if stop:
            text = tok.decode(generated, skip_special_tokens=True)
            if any(s in text for s in stop):
                reason = "stop"
    if not reason and step_i == max_new_tokens - 1:
        reason = "length"
    return StepEvent(q, step, finished=bool(reason), stop_reason=reason)


def role_setup(
    lm: LoadedModel, plans: Sequence[PromptPlan], policy: Policy
) -> tuple[list[dict[str, ContextSpec]], list[str]]:
    """Prepare ``policy`` and build every query's contexts; returns them and the roles in
    use (the policy's roles in its order, then any other role its contexts name, sorted)."""
    policy.prepare(lm)
    per_query = [policy.contexts(p) for p in plans]
    roles = [r for r in policy.roles if any(r in c for c in per_query)]
    roles += sorted({r for c in per_query for r in c} - set(roles))
    return per_query, roles


def views_for(rows: dict[str, dict[int, tuple[RoleBatch, int]]], q: int) -> dict[str, ContextView]:
    """The views of query ``q``'s contexts (role -> query -> (batch, row) in ``rows``); a
    view's per-layer record is built only when the rule reads it (most steps never do)."""
    views = {}
    for role, where in rows.items():
        if q in where:
            b, r = where[q]
            rec = (lambda recs=b.records, r=r: recs.select([r])) if b.records is not None else None
            views[role] = ContextView(b, r, rec)
    return views


#: A batch drops the rows of finished queries once they are at least this share of its rows
#: (each drop copies the kept rows' KV cache once, so not for every single finished row).
DROP_SHARE = 0.25


def drop_finished(ready: Prefilled, done: Sequence[bool]) -> bool:
    """Drop the rows of finished queries from the batches that hold enough of them
    (:data:`DROP_SHARE`) and can (:meth:`RoleBatch.keep_rows`), and update ``ready.rows``;
    returns whether any batch changed. A finished row otherwise keeps being computed, with
    padding tokens, until the last query of the batch finishes."""
    moved: dict[int, dict[int, int]] = {}
    for b in ready.batches.values():
        gone = sum(1 for q in b.query_idx if done[q])
        if not gone or gone < DROP_SHARE * len(b.query_idx) or gone == len(b.query_idx):
            continue
        if not b.can_keep_rows():
            continue
        keep = [r for r, q in enumerate(b.query_idx) if not done[q]]
        b.keep_rows(keep)
        moved[id(b)] = {old: new for new, old in enumerate(keep)}
    if not moved:
        return False
    rows: dict[str, dict[int, tuple[RoleBatch, int]]] = {}
    for role, where in ready.rows.items():
        rows[role] = {}
        for q, (b, r) in where.items():
            if id(b) not in moved:
                rows[role][q] = (b, r)
            elif r in moved[id(b)]:
                rows[role][q] = (b, moved[id(b)][r])
    ready.rows = rows
    return True


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    prefill: PrefillFn | None = None,
    choose_many: ChooseFn | None = None,
) -> Iterator[StepEvent]:
    """Greedy multi-context decoding of a batch of queries under one policy, step by step.

    Yields one :class:`StepEvent` per chosen token as soon as it is chosen (the final event
    of a query has ``finished=True`` and its ``stop_reason``: ``eos``, ``stop`` or
    ``length``). EOS tokens end a query and are not yielded as text. ``prefill`` builds the
    batches (default :func:`.prefill.plain_prefill`, one batch per role) and
    ``choose_many`` makes the choices of a step with several queries (default
    ``policy.choose_many``); the runner (:func:`..runner.decode_loop`) passes those of
    :mod:`..accel` that its ``speed=`` asks for, and picks blockwise verification there.
    A sequence-level rule (``policy.sequence_level``) is decoded by
    :func:`.sequence.decode_sequence` instead.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if policy.sequence_level:
        raise ValueError(
            f"policy {policy.name!r} is sequence-level: decode it with "
            "engine.sequence.decode_sequence (or runner.decode_loop, which picks it)"
        )
    # A rule that owns its decoding altogether.
    if policy.decode is not None:
        yield from policy.decode(lm, plans, max_new_tokens=max_new_tokens, stop=stop, timings=timings)
        return
    per_query, roles = role_setup(lm, plans, policy)
    timings = timings if timings is not None else {}

    t0 = time.perf_counter()
    with torch.inference_mode():
        ready = (prefill or plain_prefill)(roles, per_query, lm, policy)
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        timings["fused"] = float(ready.fused)
        timings["packed"] = float(ready.packed)
        if ready.reused_s:
            timings["prefill_reused_s"] = timings.get("prefill_reused_s", 0.0) + ready.reused_s

        generated: list[list[int]] = [[] for _ in plans]
        done = [False] * len(plans)
        t1 = time.perf_counter()
        for step_i in range(max_new_tokens):
            chosen = [lm.pad_token_id] * len(plans)
            active = [q for q in range(len(plans)) if not done[q]]
            all_views = [views_for(ready.rows, q) for q in active]
            # All queries of the step at once: the speed paths may share work between them
            # (one logit-lens product for every query whose contexts disagree).
            if len(active) == 1:
                choices = [policy.choose(all_views[0], lm)]
            elif choose_many is not None:
                choices = choose_many(policy, all_views, lm)
            else:
                choices = policy.choose_many(all_views, lm)
            for q, views, choice in zip(active, all_views, choices, strict=True):
                chosen[q] = int(choice.token_id)
                ev = step_event(lm, q, step_i, choice, views, generated[q], stop, max_new_tokens)
                done[q] = ev.finished
                yield ev
            if all(done):
                break
            drop_finished(ready, done)
            new = torch.tensor(chosen, dtype=torch.long)
            for b in ready.batches.values():
                b.forward(new[b.query_idx])
        timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1


def teacher_force(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    targets: Sequence[Sequence[int]],
) -> Iterator[tuple[int, int, dict[str, ContextView]]]:
    """Walk every query's contexts along a fixed continuation (teacher forcing).

    The same contexts, KV caches and probes as :func:`decode_loop` (each role prefilled on
    its own, no fusion), but instead of letting ``policy`` choose, token ``targets[q][i]``
    is fed to all contexts of query ``q`` after step ``i``. Yields ``(query_idx, i,
    views)`` where the views' logits predict ``targets[q][i]``; consume the views before
    advancing the iterator (the next step overwrites them). Used for gold-continuation
    scoring (token-level AUC) and RAG-Sequence's cross-scoring.
    """
    if len(plans) != len(targets):
        raise ValueError(f"got {len(plans)} plans but {len(targets)} target sequences")
    per_query, roles = role_setup(lm, plans, policy)
    n_steps = max((len(t) for t in targets), default=0)
    if n_steps == 0:
        return
    with torch.inference_mode():
        batches: dict[str, RoleBatch] = {}
        for role in roles:
            members = [(q, c[role]) for q, c in enumerate(per_query) if role in c]
            b = RoleBatch(role, members, lm, probe=role in policy.probe_roles)
            b.forward(None)
            batches[role] = b
        rows = row_map(batches)
        for i in range(n_steps):
            for q in range(len(plans)):
                if i < len(targets[q]):
                    yield q, i, views_for(rows, q)
            if i == n_steps - 1:
                break
            new = torch.tensor(
                [int(t[i]) if i < len(t) else lm.pad_token_id for t in targets], dtype=torch.long
            )
            for b in batches.values():
                b.forward(new[b.query_idx])
