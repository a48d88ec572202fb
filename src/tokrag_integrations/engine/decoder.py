"""The step loop: queries are admitted between steps and leave when done.

A step is :meth:`Decoder.choose` (every active query's token, from the views of its contexts,
by one call of the policy for the whole batch) then :meth:`Decoder.advance` (every batch fed
the chosen tokens; finished rows retired first). Queries admitted between the two are
prefilled there, so their first choice is made together with the others' next one. A query
may be admitted with its tokens given (teacher forcing, ``forced=``): its steps record the
views of its contexts and feed the given tokens, the policy is not asked. The one scheduler
(:mod:`.scheduler`) runs every decode on this loop, RAG-Sequence's candidates and their
scoring included (:class:`.loop.SequenceDecoder`).

Speed is chosen here, from ``speed=`` (:class:`..speed.Speed`) only, through the engine's
one seam to the speed paths (:class:`.seam.SpeedPaths`): the prefill (packed / fused / split
contexts), how an admitted query's rows join the running batch where contexts are fused, the
lens handed to the policy (:func:`.view.make_lens`: ``share_lens``, the packed LM head) and the
kernels every model call of the decode runs (``cpu_kernels``). Where ``Speed.static`` is on
(``speed="cuda"``; the default on a CUDA device) and the policy has a device rule, admission,
the step and retirement are delegated to the static decode state
(:mod:`..accel.static_state`, through the seam): :meth:`Decoder.choose` is then one captured
step with one host read, and :meth:`Decoder.advance` only frees finished rows.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.citations import citation_layers, passage_scores
from ..attention.parts import model_parts
from ..contexts.batch import RoleBatch
from ..models import LoadedModel
from ..policies.base import Choice, ContextSpec, Policy
from ..policies.rag_token import passage_posterior
from ..prompts import PromptPlan
from ..speed import Speed, speed_of
from ..trace import Candidate, TraceStep
from .sampler import GREEDY, Picker, QuerySampling, advance_constraint
from .seam import SpeedPaths, static_decode
from .stats import distribution_stats_rows
from .view import ContextView, make_lens

#: A batch drops the rows of finished queries once they are at least this share of its rows
#: (each drop copies the kept rows' KV cache once, so not for every single finished row).
DROP_SHARE = 0.25


@dataclass
class StepEvent:
    """A token chosen for query ``query_idx`` (returned by :meth:`Decoder.choose`)."""

    query_idx: int
    step: TraceStep
    finished: bool = False
    stop_reason: str = ""
    #: A teacher-forced step: the views of the query's contexts, whose logits predict the
    #: given token (read them before the next :meth:`Decoder.advance`).
    views: dict[str, ContextView] | None = None

#: The trace source of a teacher-forced step (its token was given, not chosen).
FORCED = "forced"


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
        text="" if tid in lm.eos_token_ids else tok.decode([tid]),
        source=choice.source,
        candidates=cands,
        signals=choice.signals,
        stats=stats,
    )
    return end_event(lm, q, step, generated, stop, max_new_tokens)


def end_event(
    lm: LoadedModel,
    q: int,
    step: TraceStep,
    generated: list[int],
    stop: Sequence[str],
    max_new_tokens: int,
) -> StepEvent:
    """The event of a trace step: whether its token ends the query (EOS, a stop string, the
    length); the token is appended to ``generated`` unless it is EOS."""
    tok, tid, step_i = lm.tokenizer, step.token_id, step.index
    is_eos = tid in lm.eos_token_ids
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
    lm: LoadedModel, plans: Sequence[PromptPlan], policy: Policy, cite: bool | None = False
) -> tuple[list[dict[str, ContextSpec]], list[str], frozenset[str]]:
    """Prepare ``policy`` and build every query's contexts; returns them, the roles in use
    (the policy's roles in its order, then any other role its contexts name, sorted) and the
    probed roles. ``cite=True``: the ``rag`` context of every query that has one is probed
    (its attention rows give the citations)."""
    policy.prepare(lm)
    per_query = [policy.contexts(p) for p in plans]
    for c in per_query if cite is True else ():
        if "rag" in c and c["rag"].rt_positions:
            c["rag"].probe = True
    roles = [r for r in policy.roles if any(r in c for c in per_query)]
    roles += sorted({r for c in per_query for r in c} - set(roles))
    probe = frozenset(r for c in per_query for r, s in c.items() if s.probe)
    return per_query, roles, probe


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


class Decoder:
    """Greedy multi-context decoding of a changing set of queries under one policy, with
    the speed paths of ``speed`` (a :class:`.speed.Speed`, a preset name or a dict).

    Query ids are given in admission order (0, 1, ...). ``timings``: the last admission's
    ``prefill_s``, ``fused`` / ``packed`` and ``prefill_reused_s`` (where some prefill came
    from the shared-prefill store); the caller times the steps. ``citations``:
    at every step of a query whose ``rag`` context holds its passages, the trace step gets
    each passage's share of the attention (:func:`..attention.citations.passage_scores`);
    None: only where the policy probes that context anyway, True: it is probed for them.
    """

    def __init__(
        self,
        lm: LoadedModel,
        policy: Policy,
        *,
        max_new_tokens: int = 64,
        stop: Sequence[str] = (),
        speed: Speed | str | Mapping[str, Any] | None = None,
        citations: bool | None = False,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.lm, self.policy = lm, policy
        self.max_new_tokens, self.stop = max_new_tokens, stop
        self.timings: dict[str, float] = {}
        self.speed = speed_of(speed)
        #: The speed paths of this decode (every choice from ``self.speed``).
        self.paths = SpeedPaths(lm, self.speed)
        self._prefill = self.paths.prefill
        #: A query admitted while others decode is prefilled as rows ``join`` can merge.
        self._join_prefill = self.paths.join_prefill
        self._join = self.paths.join
        self._lens = make_lens(lm, share=self.speed.share_lens, product=self.paths.lens_product)
        self.batches: list[RoleBatch] = []
        self.rows: dict[str, dict[int, tuple[RoleBatch, int]]] = {}
        self.generated: list[list[int]] = []
        self.steps: list[int] = []
        self.done: list[bool] = []
        self._chosen: dict[int, int] = {}
        #: Teacher-forced queries: their given tokens.
        self._forced: dict[int, list[int]] = {}
        #: Per query: how its tokens are taken (greedy / sampled, its constraint).
        self.sampling: list[QuerySampling] = []
        self._picker = Picker(lm)
        self.citations, self._cite_layers = citations, []
        if citations is not False:
            try:
                self._cite_layers = citation_layers(model_parts(lm.model).num_layers)
            except ValueError as e:  # an architecture the probes cannot read
                if citations:
                    warnings.warn(f"no citations: {e}", stacklevel=3)
                self.citations = False
        #: Per query: its passages' token counts in its ``rag`` context (None: not cited).
        self._cite: list[list[int] | None] = []
        #: The static state of ``Speed.static`` (:mod:`..accel.static_state`), and why it
        #: was asked for and does not apply (e.g. a policy without a device rule).
        self._static, self.static_off = static_decode(
            lm, policy, self.speed, max_new_tokens=max_new_tokens, citations=self.citations
        )

    # ------------------------------------------------------------------ bookkeeping
    @property
    def active(self) -> list[int]:
        """The ids of the queries still decoding."""
        return [q for q, d in enumerate(self.done) if not d]

    def rows_in_use(self) -> int:
        """Context rows the batches hold (finished rows not dropped yet included)."""
        if self._static is not None:
            return self._static.rows_in_use()
        return sum(len(b.query_idx) for b in self.batches)

    def width(self) -> int:
        """The longest row (positions) of any batch, 0 with none."""
        if self._static is not None:
            return self._static.width()
        return max((int(b.mask.shape[1]) for b in self.batches), default=0)

    # ------------------------------------------------------------------ admission
    def admit(
        self,
        plans: Sequence[PromptPlan],
        forced: Sequence[Sequence[int]] | None = None,
        sampling: Sequence[QuerySampling] | None = None,
    ) -> list[int]:
        """Prefill ``plans`` and add them to the decode; returns their query ids. Their
        first token is chosen at the next :meth:`choose`. ``forced`` (one non-empty token list
        per plan): teacher forcing, each query's steps give its views and feed these tokens
        (the query ends after the last). ``sampling``: one per plan, how its tokens are
        taken (default: greedy, unconstrained)."""
        if not plans:
            return []
        if sampling is not None and len(sampling) != len(plans):
            raise ValueError("sampling needs one QuerySampling per plan")
        if forced is not None:
            if len(forced) != len(plans) or any(len(t) == 0 for t in forced):
                raise ValueError("forced needs one non-empty token list per plan")
        if forced is not None and self._static is not None:
            if self._static.rows_in_use():
                raise RuntimeError("a static decode feeds its own tokens: no teacher forcing")
            self._static, self.static_off = None, "teacher forcing runs on the view path"
        per_query, roles, probe = role_setup(self.lm, plans, self.policy, self.citations)
        base = len(self.done)
        ids = [base + q for q in range(len(plans))]
        if self._static is None:
            prefill = self._join_prefill if self.batches else self._prefill
            t0 = time.perf_counter()
            with torch.inference_mode(), self.paths.scope():
                ready = prefill(roles, per_query, self.lm, probe)
            self.timings = {
                "prefill_s": time.perf_counter() - t0,
                "fused": float(ready.fused),
                "packed": float(ready.packed),
            }
            if ready.reused_s:
                self.timings["prefill_reused_s"] = ready.reused_s
            for q, tokens in zip(ids, forced or (), strict=False):
                self._forced[q] = [int(t) for t in tokens]
            for b in ready.batches.values():
                b.query_idx = [base + q for q in b.query_idx]
        self.generated += [[] for _ in plans]
        self.sampling += list(sampling) if sampling is not None else [GREEDY] * len(plans)
        self.steps += [0] * len(plans)
        self.done += [False] * len(plans)
        for plan, ctx in zip(plans, per_query, strict=True):
            rag = ctx.get("rag")
            cited = self.citations is not False and rag is not None and rag.probe
            cited = cited and rag.rt_positions == plan.retrieved_positions  # type: ignore[union-attr]
            self._cite.append([e - s for s, e in plan.passage_spans] if cited else None)
        if self._static is not None:
            with self.paths.scope():
                self.timings = self._static.admit(
                    ids,
                    per_query,
                    roles,
                    self._cite[base:],
                    self._join_prefill,
                    [(s.sampling, s.constraint) for s in self.sampling[base:]],
                )
            return ids
        new_rows = {
            role: {base + q: br for q, br in where.items()} for role, where in ready.rows.items()
        }
        for role, where in new_rows.items():
            self.rows.setdefault(role, {}).update(where)
        for b in ready.batches.values():
            self._add_batch(b)
        return ids

    def _add_batch(self, new: RoleBatch) -> None:
        """Merge ``new`` into a running batch where ``join`` can, else keep it apart."""
        if self._join is not None:
            for i, old in enumerate(self.batches):
                with torch.inference_mode():
                    merged = self._join(old, new)
                if merged is None:
                    continue
                self.batches[i] = merged
                n = len(old.query_idx)
                self._rebind(
                    {
                        id(old): (merged, {r: r for r in range(n)}),
                        id(new): (merged, {r: n + r for r in range(len(new.query_idx))}),
                    }
                )
                return
        self.batches.append(new)

    def _rebind(self, moved: dict[int, tuple[RoleBatch, dict[int, int]]]) -> None:
        """Point every context of a batch in ``moved`` (id -> its new batch, and old row ->
        new row; a row not there is gone) at its new place."""
        rows: dict[str, dict[int, tuple[RoleBatch, int]]] = {}
        for role, m in self.rows.items():
            rows[role] = {}
            for q, (b, r) in m.items():
                if id(b) not in moved:
                    rows[role][q] = (b, r)
                elif r in moved[id(b)][1]:
                    rows[role][q] = (moved[id(b)][0], moved[id(b)][1][r])
        self.rows = rows

    def cancel(self, q: int) -> None:
        """Stop query ``q`` without another event; its rows leave at the next advance."""
        self.done[q] = True
        self._chosen.pop(q, None)
        self._forced.pop(q, None)

    # ------------------------------------------------------------------ one step
    def choose(self) -> list[StepEvent]:
        """Choose every active query's next token; returns the step events in query order
        (``finished`` ones end their query)."""
        with torch.inference_mode(), self.paths.scope():
            return self._choose()

    def _choose(self) -> list[StepEvent]:
        if self._static is not None:
            return self._static_choose(self.active)
        events = [self._forced_step(q) for q in self.active if q in self._forced]
        active = [q for q in self.active if q not in self._forced]
        all_views = [views_for(self.rows, q) for q in active]
        qs = [self.sampling[q] for q in active]
        allowed = self._picker.mask(qs, all_views)  # a constraint masks every context
        choices = self.policy.choose(all_views, self._lens) if active else []
        picked = self._picker.pick(qs, choices, allowed, [self.steps[q] for q in active])
        for q, views, choice, got in zip(active, all_views, choices, picked, strict=True):
            if got.token_id != choice.token_id:  # drawn from the rule's distribution
                choice = dataclasses.replace(choice, token_id=got.token_id)
            ev = step_event(
                self.lm,
                q,
                self.steps[q],
                choice,
                views,
                self.generated[q],
                self.stop,
                self.max_new_tokens,
            )
            ev.step.logprob, ev.step.top_logprobs = got.logprob, got.top
            self._constrain(q, ev)
            lengths = self._cite[q]
            if lengths is not None:
                rag = views["rag"]
                rows = rag.attention_rows(self._cite_layers)
                ev.step.citation = passage_scores(
                    rows,
                    list(rag.rt_positions.split(lengths)),
                    list(rag.rt_token_ids.split(lengths)),
                    int(choice.token_id),
                )
            elif (
                self.citations is not False
                and views
                and all(r.startswith("passage:") for r in views)
            ):
                per = sorted(views.items(), key=lambda kv: int(kv[0].split(":")[1]))
                tid = int(choice.token_id)
                ev.step.citation = passage_posterior(
                    [v.spec.weight for _, v in per], [float(v.probs[tid]) for _, v in per]
                )
            self.steps[q] += 1
            self.done[q] = ev.finished
            self._chosen[q] = int(choice.token_id)
            events.append(ev)
        return events

    def _constrain(self, q: int, ev: StepEvent) -> None:
        """Feed query ``q``'s constraint the token; a complete grammar ends the query."""
        if advance_constraint(self.sampling[q], ev.step.token_id, self.lm.eos_token_ids):
            ev.finished, ev.stop_reason = True, "stop"

    def _static_choose(self, active: list[int]) -> list[StepEvent]:
        """The step on the static state (one read), its records turned into trace steps."""
        assert self._static is not None
        events = []
        tok = self.lm.tokenizer
        for q, d in zip(active, self._static.step(active, tok), strict=True):
            tid = d.token_id
            step = TraceStep(
                index=self.steps[q],
                token_id=tid,
                text="" if tid in self.lm.eos_token_ids else tok.decode([tid]),
                source=d.source,
                candidates=d.candidates,
                signals=d.signals,
                stats=d.stats,
                logprob=d.logprob,
                top_logprobs=d.top_logprobs,
            )
            if d.citation is not None:
                step.citation = d.citation
            ev = end_event(self.lm, q, step, self.generated[q], self.stop, self.max_new_tokens)
            self._constrain(q, ev)
            self.steps[q] += 1
            self.done[q] = ev.finished
            events.append(ev)
        return events

    def _forced_step(self, q: int) -> StepEvent:
        """A teacher-forced query's step: its views, and its given token to feed."""
        tokens, i = self._forced[q], self.steps[q]
        tid = tokens[i]
        step = TraceStep(index=i, token_id=tid, text=self.lm.tokenizer.decode([tid]), source=FORCED)
        last = i == len(tokens) - 1
        self.steps[q] += 1
        self.done[q] = last
        self._chosen[q] = tid
        if last:
            del self._forced[q]
        views = views_for(self.rows, q)
        return StepEvent(q, step, finished=last, stop_reason="forced" if last else "", views=views)

    def advance(self) -> None:
        """Feed every batch the tokens chosen (or given) at the last :meth:`choose` (padding
        for finished rows), after dropping finished rows and batches. On the static state the
        step fed its tokens already: the finished queries' rows are freed."""
        if self._static is not None:
            self._static.retire([q for q, d in enumerate(self.done) if d])
            return
        self._retire()
        if not self.batches:
            self._chosen.clear()
            return
        pad = self.lm.pad_token_id
        with torch.inference_mode(), self.paths.scope():
            for b in self.batches:
                new = torch.tensor(
                    [pad if self.done[q] else self._chosen.get(q, pad) for q in b.query_idx],
                    dtype=torch.long,
                )
                b.forward(new)
        self._chosen.clear()

    def _retire(self) -> None:
        """Remove batches whose queries all finished; drop the finished rows of a batch once
        they are :data:`DROP_SHARE` of it (and it can)."""
        keep: list[RoleBatch] = []
        moved: dict[int, tuple[RoleBatch, dict[int, int]]] = {}
        for b in self.batches:
            gone = sum(1 for q in b.query_idx if self.done[q])
            if gone == len(b.query_idx):
                moved[id(b)] = (b, {})
                continue
            keep.append(b)
            if gone and gone >= DROP_SHARE * len(b.query_idx) and b.can_keep_rows():
                kept = [r for r, q in enumerate(b.query_idx) if not self.done[q]]
                b.keep_rows(kept)
                moved[id(b)] = (b, {old: new for new, old in enumerate(kept)})
        self.batches = keep
        if moved:
            self._rebind(moved)
