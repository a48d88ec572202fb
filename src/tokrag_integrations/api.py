"""Public entry points: generate, stream, generate_batch and their async forms.

Every entry point takes ``policy=`` and its ``policy_options={...}`` (checked once, by
:func:`.policies.get_policy`), and ``speed=`` (:class:`.engine.speed.Speed`: how fast,
never what is decided). The results are in :mod:`.results`, the stream's thread machinery in
:mod:`.streams`, the checks of the inputs in :mod:`.inputs`; their public names are
importable from here too.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .defaults import MAX_NEW_TOKENS
from .engine.loop import StepEvent
from .engine.speed import PRESETS, Speed
from .inputs import _DEFAULT, _check_inputs, _check_query, _plans
from .models import LoadedModel
from .policies import get_policy, merge_policy_options
from .policies.base import Policy
from .prompts import PromptPlan, RenderedPrompt
from .results import GenerationResult, TokenEvent, _stop_list, _TextTracker
from .runner import decode_loop, resolve_speed
from .streams import (
    _END,
    DEFAULT_IDLE_TIMEOUT,
    IDLE_TIMEOUT_ENV,
    StreamAbandoned,
    TokenStream,
    _acquire,
    _Cancelled,
    idle_timeout_from,
    run_cancellable,
)
from .trace import Trace

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "IDLE_TIMEOUT_ENV",
    "GenerationResult",
    "StreamAbandoned",
    "TokenEvent",
    "TokenStream",
    "agenerate",
    "astream",
    "astream_with_result",
    "generate",
    "generate_batch",
    "idle_timeout_from",
    "run_cancellable",
    "stream",
]


def _speed_paths_off(lm: LoadedModel) -> dict[str, Any]:
    """``{"speed_paths_off": {path: reason}}`` for the trace options where some speed path is
    off on this model (non-CPU device, non-float32 dtype, architecture outside the tested
    matrix, ``cpu_kernels='off'``), else nothing."""
    from .accel.install import speed_paths

    # "on" may carry what was measured ("on (...)"): only the paths that are off count.
    off = {k: v.removeprefix("off: ") for k, v in speed_paths(lm.model).items() if v.startswith("off")}
    return {"speed_paths_off": off} if off else {}


def _run(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None],
    *,
    holder: list[GenerationResult],
    cancel: threading.Event | None = None,
    **kwargs: Any,
) -> Iterator[TokenEvent]:
    """Validate everything, build the prompts (:func:`_prepare`, which takes the other
    keyword arguments), and return the (not yet started) decode.

    The decode takes ``lm.lock`` on its first step and releases it when it ends or is closed;
    with ``cancel`` it stops (``_Cancelled``) at the first step after ``cancel`` is set.
    """
    p = _prepare(lm, queries, passages, **kwargs)
    if not p.plans:
        return iter(())
    return _events(
        lm,
        p.policies,
        p.groups,
        p.plans,
        p.traces,
        p.trackers,
        holder,
        max_new_tokens=kwargs["max_new_tokens"],
        stop=p.stops,
        speed=p.speed,
        cancel=cancel,
    )


@dataclass
class _Prepared:
    """A decode ready to run: the policies by group (``main``, and ``llm`` for queries
    without usable passages), the groups' query indices, and per query its prompt plan,
    trace and text tracker."""

    policies: dict[str, Policy]
    groups: dict[str, list[int]]
    plans: list[PromptPlan]
    traces: list[Trace]
    trackers: list[_TextTracker]
    stops: list[str]
    speed: Speed


def _record_event(trace: Trace, tracker: _TextTracker, ev: StepEvent) -> str | None:
    """Add a decode event to its query's trace and text; returns the new text (None or ``""``
    where there is none: an EOS adds no step)."""
    is_eos = ev.stop_reason == "eos"
    if not is_eos:
        trace.steps.append(ev.step)
    delta = tracker.push(None if is_eos else ev.step.token_id, ev.finished)
    if ev.finished:
        trace.stop_reason = ev.stop_reason
    return delta


def _result(trace: Trace, tracker: _TextTracker) -> GenerationResult:
    """The finished query's result (its text, trace and token ids)."""
    trace.text = tracker.final if tracker.final is not None else tracker.text()
    return GenerationResult(text=trace.text, trace=trace, token_ids=list(tracker.ids))


def _prepare(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None],
    *,
    policy: str | Policy,
    max_new_tokens: int,
    stop: str | Sequence[str] | None,
    messages: Sequence[list[dict[str, str]] | None] | None,
    system_prompt: Any,
    max_context_tokens: int | None,
    options: dict[str, Any] | None = None,
    rendered: Sequence[RenderedPrompt | None] | None = None,
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    prompt_format: str = "qa",
    caller: str = "generate",
) -> _Prepared:
    """Validate everything and build the prompts, traces and text trackers of a decode
    (:func:`_run`; the continuous micro-batcher prepares each request with it).

    ``options``: the deprecated ``**options`` of the entry point ``caller`` (policy options
    mixed with the others), merged into ``policy_options`` with a ``DeprecationWarning``.
    ``queries`` may be empty: then ``plans`` is empty too.
    """
    if not isinstance(lm, LoadedModel):
        raise TypeError("the first argument must be a LoadedModel from tokrag_integrations.load_model()")
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings")
    if len(queries) != len(passages):
        raise ValueError(f"got {len(queries)} queries but {len(passages)} passage lists")
    queries = [_check_query(q, i if len(queries) > 1 else None) for i, q in enumerate(queries)]
    _check_inputs(queries, passages, rendered, max_new_tokens, max_context_tokens)
    if not queries:
        return _Prepared({}, {}, [], [], [], [], PRESETS["auto"])
    options = dict(options or {})
    # Raw-prompt path of the adapters (see PromptBuilder.build); not a policy option.
    prompt_format = options.pop("prompt_format", prompt_format)
    # The warning names the user's call (generate goes through _generate).
    depth = 6 if caller == "generate" else 5
    pol = get_policy(policy, **merge_policy_options(policy_options, options, caller, stacklevel=depth))
    chosen_speed = resolve_speed(speed, pol)
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
    llm_pol = get_policy("llm")
    for i, p in enumerate(plans):
        fallback = pol.uses_passages and not p.has_passages
        if fallback:
            msg = f"query {i}: no usable passages, answered from the pure context (policy 'llm' instead of {pol.name!r})"
            p.warnings.append(msg)
            if passages[i]:
                warnings.warn(msg, stacklevel=5)
        groups.setdefault("llm" if fallback else "main", []).append(i)

    traces = [
        Trace(
            query=queries[i],
            policy=pol.name,
            model=lm.name,
            options={**pol.options(), **chosen_speed.options(), **_speed_paths_off(lm)},
            passages=plans[i].passages,
            warnings=list(plans[i].warnings),
            prompt_tokens={"pure": len(plans[i].pure_ids), "rag": len(plans[i].rag_ids) if plans[i].has_passages else 0},
        )
        for i in range(len(queries))
    ]
    trackers = [_TextTracker(lm.tokenizer, stops) for _ in queries]

    return _Prepared(
        {"main": pol, "llm": llm_pol}, groups, plans, traces, trackers, stops, chosen_speed
    )


def _events(
    lm: LoadedModel,
    policies: dict[str, Policy],
    groups: dict[str, list[int]],
    plans: list[PromptPlan],
    traces: list[Trace],
    trackers: list[_TextTracker],
    holder: list[GenerationResult],
    *,
    max_new_tokens: int,
    stop: list[str],
    speed: Speed,
    cancel: threading.Event | None,
) -> Iterator[TokenEvent]:
    """The decode of :func:`_run`: each group of queries (``groups``: name -> query indices)
    under its policy (``policies[name]``), one :class:`TokenEvent` per chosen token; at the
    end, one :class:`GenerationResult` per query appended to ``holder``."""
    # The model lock is taken on the first next(), not when the stream is created, so
    # an unread stream never blocks other users of the model.
    _acquire(lm.lock, cancel)
    try:
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        for group, idx in groups.items():
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            for ev in decode_loop(
                lm,
                [plans[i] for i in idx],
                policies[group],
                max_new_tokens=max_new_tokens,
                stop=stop,
                timings=timings,
                speed=speed,
            ):
                q = idx[ev.query_idx]
                delta = _record_event(traces[q], trackers[q], ev)
                if ev.stop_reason != "eos" or delta:
                    yield TokenEvent(q, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step)
                if cancel is not None and cancel.is_set():
                    raise _Cancelled
            total = time.perf_counter() - t0
            for i in idx:
                traces[i].timings = {**timings, "total_s": total, "queries_in_batch": float(len(idx))}
    finally:
        lm.lock.release()
    for q, tr in enumerate(traces):
        holder.append(_result(tr, trackers[q]))


def generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    prompt_format: str = "qa",
    rendered: RenderedPrompt | None = None,
    **options: Any,
) -> GenerationResult:
    """Answer ``query`` with ``passages`` (ranked, best first) under a decoding ``policy``.

    Decodes in the calling thread, holding ``lm.lock`` (one decode at a time per model; other
    threads wait, an idle stream is abandoned after its idle timeout, see :class:`TokenStream`).

    Args:
        lm: from :func:`tokrag_integrations.load_model`.
        query: the question (the content of the final user turn).
        passages: a list of strings, :class:`Passage` objects or (text, score) pairs; empty
            or None answers from the pure context and records that in the trace.
        policy: ``"tokrag"`` (default), ``"rag"``, ``"llm"``... or a Policy instance.
        policy_options: the policy's options (e.g. ``{"pr_norm": "softmax"}``,
            ``{"variant": "reference"}``), checked by :func:`.policies.get_policy`.
        speed: how fast, never what is decided: a :class:`.engine.speed.Speed`, a preset
            (``"auto"``, the default; ``"reference"``, the step-by-step loop as written) or a
            dict of its fields (``{"speculative": True}``).
        max_new_tokens / stop: stopping rules (EOS always stops).
        messages: earlier chat turns (role/content dicts) placed before the question.
        system_prompt: override the builder's default system prompt (None = no system turn).
        max_context_tokens: a tighter context budget than the model's window.
        prompt_format: ``"chat"``/``"text"`` (without passages: the query as the raw user
            turn or the exact prompt, no default system prompt; see ``PromptBuilder.build``).
        rendered: a ``RenderedPrompt`` instead of ``passages``: the RAG context is the
            caller's own formatted prompt and its retrieved tokens are where its context
            variable landed (the framework adapters' path; see ``PromptBuilder.build_rendered``).
        **options: deprecated: the policy's options as keywords (a ``DeprecationWarning``;
            use ``policy_options``).

    Raises:
        TypeError / ValueError: a bad argument (checked before anything is decoded).
    """
    return _generate(
        lm,
        query,
        passages,
        policy=policy,
        policy_options=policy_options,
        speed=speed,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=messages,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        prompt_format=prompt_format,
        rendered=rendered,
        **options,
    )


def _generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    prompt_format: str = "qa",
    rendered: RenderedPrompt | None = None,
    cancel: threading.Event | None = None,
    **options: Any,
) -> GenerationResult:
    holder: list[GenerationResult] = []
    events = _run(
        lm,
        [query],
        [passages],
        policy=policy,
        policy_options=policy_options,
        speed=speed,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=[messages] if messages else None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
        cancel=cancel,
        rendered=None if rendered is None else [rendered],
        prompt_format=prompt_format,
        caller="generate",
    )
    for _ in events:
        pass
    return holder[0]


def stream(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    prompt_format: str = "qa",
    rendered: RenderedPrompt | None = None,
    idle_timeout: float | None = None,
    **options: Any,
) -> TokenStream:
    """Like :func:`generate` (the same arguments) but yields a :class:`TokenEvent` per
    chosen token as it is chosen.

    Validation (empty query, unknown policy, bad arguments, prompt too long) happens here,
    before the first token, so errors surface at the call site.

    The returned :class:`TokenStream` may be read from any thread. It holds the model from its
    first ``next()`` until it is exhausted, closed, garbage collected or abandoned: once
    started, a stream nobody reads for ``idle_timeout`` seconds (default
    ``$TOKRAG_STREAM_IDLE_TIMEOUT`` or 30) is closed to free the model, and reading it again
    raises :class:`StreamAbandoned`. Use ``with stream(...) as s:`` or ``s.close()`` to stop
    early.
    """
    holder: list[GenerationResult] = []
    stop_event = threading.Event()
    timeout = idle_timeout_from(idle_timeout)
    gen = _run(
        lm,
        [query],
        [passages],
        policy=policy,
        policy_options=policy_options,
        speed=speed,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=[messages] if messages else None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
        cancel=stop_event,
        rendered=None if rendered is None else [rendered],
        prompt_format=prompt_format,
        caller="stream",
    )
    return TokenStream(gen, holder, stop=stop_event, idle_timeout=timeout, model_lock=lm.lock)


def generate_batch(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None] | None = None,
    *,
    policy: str | Policy = "tokrag",
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    max_context_tokens: int | None = None,
    system_prompt: Any = _DEFAULT,
    prompt_format: str = "qa",
    **options: Any,
) -> list[GenerationResult]:
    """Decode several queries as one batch (one forward pass per context role per step);
    the arguments are those of :func:`generate`.

    ``queries`` is a list of strings and ``passages`` (if given) one list of passages per
    query; a single string for either is refused.
    """
    if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence):
        raise TypeError(
            f"queries must be a list of strings, got a {type(queries).__name__}; "
            "for one question use generate() or pass [question]"
        )
    if passages is not None and (isinstance(passages, (str, bytes)) or not isinstance(passages, Sequence)):
        raise TypeError(f"passages must be a list with one list of passages per query, got a {type(passages).__name__}")
    holder: list[GenerationResult] = []
    plist = list(passages) if passages is not None else [None] * len(queries)
    for _ in _run(
        lm,
        list(queries),
        plist,
        policy=policy,
        policy_options=policy_options,
        speed=speed,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
        prompt_format=prompt_format,
        caller="generate_batch",
    ):
        pass
    return holder


async def agenerate(lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any) -> GenerationResult:
    """Async :func:`generate`: the model runs in a worker thread, never on the event loop.

    Cancelling the task stops the decode at its next step (or while it waits for the model);
    the cancellation is re-raised once the worker has let go of the model.
    """
    return await run_cancellable(lambda cancel: _generate(lm, query, passages, cancel=cancel, **kwargs))


async def astream(
    lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any
) -> AsyncIterator[TokenEvent]:
    """Async :func:`stream`: tokens are produced in a worker thread and handed to the loop.

    Yields only :class:`TokenEvent` objects; use :func:`astream_with_result` to also receive
    the final :class:`GenerationResult`. Cancelling the consuming task (or closing the
    iterator) stops the decode at its next step.
    """
    async for ev in astream_with_result(lm, query, passages, **kwargs):
        if isinstance(ev, TokenEvent):
            yield ev


async def astream_with_result(
    lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any
) -> AsyncIterator[TokenEvent | GenerationResult]:
    """Yields every :class:`TokenEvent` and finally the :class:`GenerationResult`.

    Cancelling the consuming task or closing the iterator early stops the decode at its next
    step and waits (off the loop) until the model is free again.
    """
    async for item in _aiterate(functools.partial(stream, lm, query, passages, **kwargs)):
        yield item


async def _aiterate(open_stream: Callable[[], TokenStream]) -> AsyncIterator[TokenEvent | GenerationResult]:
    """The events of the stream ``open_stream()`` opens (in a worker thread), then its result,
    read off the event loop; the stream is closed however the iteration ends."""
    loop = asyncio.get_running_loop()
    s = await asyncio.to_thread(open_stream)
    try:
        while True:
            item = await loop.run_in_executor(None, s._next_or_end)
            if item is _END:
                break
            yield item
        yield s.result
    finally:
        s.close()
        await loop.run_in_executor(None, s._worker.join)
