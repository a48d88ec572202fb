"""Admission: a call checked and prepared for a decode, before anything is decoded (its
prompts, policy, ``Speed``, traces and text trackers: :func:`_prepare`), the request that
carries it through the step loop (:class:`_Request`, one :class:`_Query` per query) and the
keywords every entry point takes (:func:`_check_keywords`). The step loop that admits the
prepared calls at step boundaries is :mod:`.step`; the entry points are :mod:`.scheduler`."""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import require_bool
from ..defaults import CITATIONS, MAX_NEW_TOKENS
from ..inputs import _DEFAULT, _check_inputs, _check_query, _plans
from ..models import LoadedModel
from ..policies import get_policy, uses_passages
from ..policies.base import Policy
from ..prompts import PromptPlan, RenderedPrompt
from ..results import GenerationResult, TokenEvent, _stop_list, _TextTracker
from ..sampling import TokenConstraint, sampling_of
from ..speed import Speed, speed_of
from ..trace import Trace
from .sampler import QuerySampling

#: How a query's tokens are taken (per query: calls that differ in these share a decode).
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "top_logprobs", "constraint")
#: Per-call inputs (not settings): calls that differ only in these share a batch.
_PER_CALL = ("messages", "rendered", *_SAMPLING)


_SETTINGS = (
    "policy",
    "policy_options",
    "speed",
    "max_new_tokens",
    "stop",
    "system_prompt",
    "max_context_tokens",
    "prompt_format",
    "citations",
)


@dataclass
class _Prepared:
    """A decode ready to run: the policies by group (``main``, and ``no_rag`` for queries
    without usable passages), the groups' query indices, and per query its prompt plan,
    trace and text tracker."""

    policies: dict[str, Policy]
    groups: dict[str, list[int]]
    plans: list[PromptPlan]
    traces: list[Trace]
    trackers: list[_TextTracker]
    stops: list[str]
    speed: Speed
    max_new_tokens: int
    citations: bool | None = False
    #: Per query: how its tokens are taken.
    sampling: list[QuerySampling] = field(default_factory=list)


def _prepare(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None],
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: Sequence[list[dict[str, str]] | None] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    rendered: Sequence[RenderedPrompt | None] | None = None,
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    prompt_format: str = "qa",
    citations: bool | None = CITATIONS,
    temperature: Any = None,
    top_p: Any = None,
    top_k: Any = None,
    seed: Any = None,
    top_logprobs: Any = None,
    constraint: Any = None,
) -> _Prepared:
    """Validate everything and build the prompts, traces and text trackers of a decode
    (``queries`` may be empty: then ``plans`` is empty too).

    Raises:
        TypeError / ValueError: a bad argument, before anything is decoded.
    """
    if not isinstance(lm, LoadedModel):
        raise TypeError(
            "the first argument must be a LoadedModel from tokrag_integrations.load_model()"
        )
    if len(queries) != len(passages):
        raise ValueError(f"got {len(queries)} queries but {len(passages)} passage lists")
    queries = [_check_query(q, i if len(queries) > 1 else None) for i, q in enumerate(queries)]
    _check_inputs(queries, passages, rendered, max_new_tokens, max_context_tokens)
    seeds = _per_query("seed", seed, len(queries))
    per_sampling = [sampling_of(temperature, top_p, top_k, s, top_logprobs) for s in seeds]
    if not queries:
        return _Prepared({}, {}, [], [], [], [], speed_of(speed), max_new_tokens)
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(
            f"policy_options must be a dict of option names to values, got {type(policy_options).__name__}"
        )
    pol = get_policy(policy, **dict(policy_options or {}))
    chosen_speed = speed_of(speed)
    stops = _stop_list(stop)
    plans = _plans(
        lm,
        queries,
        passages,
        max_new_tokens=max_new_tokens,
        messages=messages,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        prompt_format=prompt_format,
        rendered=rendered,
    )
    # Queries without usable passages are answered from the pure context (and say so).
    groups: dict[str, list[int]] = {}
    no_rag_pol = get_policy("no_rag")
    for i, p in enumerate(plans):
        fallback = uses_passages(pol) and not p.has_passages
        if fallback:
            msg = f"query {i}: no usable passages, answered from the pure context (policy 'no_rag' instead of {pol.name!r})"
            p.warnings.append(msg)
            if passages[i]:
                warnings.warn(msg, stacklevel=5)
        groups.setdefault("no_rag" if fallback else "main", []).append(i)

    traces = [
        Trace(
            query=queries[i],
            policy=pol.name,
            model=lm.name,
            options=pol.options(),
            speed=chosen_speed.options(),
            passages=plans[i].passages,
            warnings=list(plans[i].warnings),
            prompt_tokens={
                "pure": len(plans[i].pure_ids),
                "rag": len(plans[i].rag_ids) if plans[i].has_passages else 0,
            },
        )
        for i in range(len(queries))
    ]
    for t, smp in zip(traces, per_sampling, strict=True):
        t.sampling = smp.record()
    trackers = [_TextTracker(lm.tokenizer, stops) for _ in queries]
    constraints = _constraints(lm, constraint, len(queries))

    return _Prepared(
        {"main": pol, "no_rag": no_rag_pol},
        groups,
        plans,
        traces,
        trackers,
        stops,
        chosen_speed,
        max_new_tokens,
        None if citations is None else require_bool(citations, "citations"),
        [QuerySampling(smp, c) for smp, c in zip(per_sampling, constraints, strict=True)],
    )


def _per_query(name: str, value: Any, n: int) -> list[Any]:
    """A keyword given once for every query, or as a list of one value per query."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be one value, or a list of one per query ({n}), got {len(value)}")
        return list(value)
    return [value] * n


def _constraints(lm: LoadedModel, constraint: Any, n: int) -> list[TokenConstraint | None]:
    """One constraint per query from ``constraint=``: a :class:`..sampling.TokenConstraint`,
    a spec (a dict: ``tokrag_integrations.structured.constraint_for``), None, or a list of
    those (one per query); one object given for several queries is forked for each."""
    given = _per_query("constraint", constraint, n)
    shared = not isinstance(constraint, (list, tuple)) and n > 1
    out: list[TokenConstraint | None] = []
    for c in given:
        if c is None:
            out.append(None)
        elif isinstance(c, Mapping):
            from ..structured import constraint_for  # optional: llguidance

            out.append(constraint_for(c, lm))
        elif isinstance(c, TokenConstraint):
            out.append(c.fork() if shared else c)
        else:
            raise TypeError(
                "constraint must be a TokenConstraint or a spec dict such as "
                f"{{'type': 'json_object'}}, got a {type(c).__name__}"
            )
    return out


@dataclass
class _Query:
    """One query of a running call: the call, the query's index in it, its trace and text
    tracker, its timings so far, and when its admission and its decode started."""

    r: _Request
    i: int
    trace: Trace
    tracker: _TextTracker
    timings: dict[str, float]
    t0: float
    t1: float
    #: Why the static state (``Speed.static``) was asked for and not used, or None.
    static_off: str | None = None


@dataclass
class _Request:
    """One call: its prepared queries (one; several for :func:`generate_batch`), and once it
    is done, their results or its error."""

    prepared: _Prepared
    cancel: threading.Event = field(default_factory=threading.Event)
    #: A stream's (or a call decoded alone's) events, in order: a :class:`TokenEvent` per
    #: chosen token, then None once its results are set (None for a batched plain call).
    events: queue.SimpleQueue[TokenEvent | None] | None = None
    #: The call decoded alone again, should the shared decode it was part of fail.
    alone: Callable[[], GenerationResult] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    results: list[GenerationResult | None] = field(default_factory=list)
    error: BaseException | None = None
    #: The context rows, longest context and prompt tokens it needs (see :meth:`_Loop._need`).
    need: tuple[int, int, int] | None = None
    queries: list[_Query] = field(default_factory=list)

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


def _request(lm: LoadedModel, query: str, passages: Any, kwargs: Mapping[str, Any]) -> _Request:
    """One call's :class:`_Request`, its keywords checked and its prompt built (at the call
    site: a bad input fails here)."""
    _check_keywords(kwargs)
    settings = {**kwargs}
    messages, rendered = settings.pop("messages", None), settings.pop("rendered", None)
    return _Request(
        _prepare(
            lm,
            [query],
            [passages],
            messages=[messages] if messages else None,
            rendered=None if rendered is None else [rendered],
            **settings,
        )
    )


def _check_keywords(kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword no entry point takes (the message names the known ones)."""
    unknown = sorted(set(kwargs) - set(_SETTINGS) - set(_PER_CALL))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}; policy options go in "
            f"policy_options={{...}}; keywords: {', '.join(_SETTINGS + _PER_CALL)}"
        )
