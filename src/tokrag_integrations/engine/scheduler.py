"""The one scheduler, and the entry points that use it: :func:`generate`, :func:`stream`,
:func:`generate_batch`, :func:`agenerate`, :func:`astream`, :func:`astream_with_result` (the
package root exports them; the framework adapters and the server call them). Every decode
runs the engine's step loop (:class:`.engine.decoder.Decoder`).

``batching=True`` (what the framework adapters and the server use): the first call with a
given set of settings (policy, its
options, speed, max_new_tokens, stop, system prompt, budget) waits ``wait_s`` for companions,
then decodes them together in a thread of its own; until that decode ends, a call with the
same settings joins it at the next step boundary (iteration-level scheduling, Orca, OSDI
2022), and a finished call leaves at once with its result. ``max_rows`` (context rows: two
per Tok-RAG query) and ``max_positions`` (rows times key/value positions) bound the memory, a
call that does not fit waits; ``max_prefill_tokens`` bounds what one step boundary prefills.
Every call gets the tokens and decisions it gets alone (tests/integration/test_batching.py);
a bad input fails its own call, at the call site. A sequence-level rule cannot take queries
mid-decode: its calls are decoded batch by batch. ``batching=False`` (the default, and
:func:`generate_batch`): the given queries decoded alone, in the calling thread, holding
``lm.lock`` (one decode at a time per model; other threads wait).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import queue
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import require_bool
from ..defaults import MAX_NEW_TOKENS
from ..inputs import _DEFAULT, _check_inputs, _check_query, _plans
from ..models import LoadedModel
from ..policies import get_policy, uses_passages
from ..policies.base import Policy, SequencePolicy
from ..prompts import PromptPlan, RenderedPrompt
from ..results import GenerationResult, TokenEvent, _stop_list, _TextTracker
from ..trace import Trace
from .decoder import Decoder, StepEvent
from .loop import decode_loop
from .speed import Speed, speed_of
from .streams import _END, TokenStream, _acquire, _Cancelled, idle_timeout_from, run_cancellable

__all__ = [
    "MicroBatcher",
    "agenerate",
    "astream",
    "astream_with_result",
    "batcher_for",
    "generate",
    "generate_batch",
    "stream",
]

#: Default wait for companions (seconds) and largest batch of a rule decoded batch by batch.
WAIT_S = 0.01
MAX_BATCH = 16
#: Default bounds of a continuous decode: context rows (two per Tok-RAG query), and key/value
#: positions (rows x (longest prompt + max_new_tokens)); about 3 GB of cache on SmolLM2-135M
#: in float32 (46 KB a position).
MAX_ROWS = 32
MAX_POSITIONS = 65536
#: Default bound on the prompt tokens prefilled at one step boundary of a running decode
#: (every context of every call admitted there; None: every call that fits). With a bound, a
#: burst of calls joins over several steps: the first calls of the burst get their first
#: token without waiting for the whole burst's prefill, at some cost in tokens/s
#: (docs/results.md, "Streams in the continuous decode"). The first call of a boundary is
#: admitted whatever its size.
MAX_PREFILL_TOKENS: int | None = None

#: Per-call inputs (not settings): calls that differ only in these share a batch.
_PER_CALL = ("messages", "rendered")
_SETTINGS = (
    "policy",
    "policy_options",
    "speed",
    "max_new_tokens",
    "stop",
    "system_prompt",
    "max_context_tokens",
    "prompt_format",
)


def _speed_paths_off(lm: LoadedModel) -> dict[str, Any]:
    """``{"speed_paths_off": {path: reason}}`` for the trace options where some speed path is
    off on this model (non-CPU device, non-float32 dtype, architecture outside the tested
    matrix, ``cpu_kernels='off'``), else nothing."""
    from ..accel.install import speed_paths

    # "on" may carry what was measured ("on (...)"): only the paths that are off count.
    off = {k: v.removeprefix("off: ") for k, v in speed_paths(lm.model).items() if v.startswith("off")}
    return {"speed_paths_off": off} if off else {}


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
    rendered: Sequence[RenderedPrompt | None] | None = None,
    policy_options: Mapping[str, Any] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
    prompt_format: str = "qa",
) -> _Prepared:
    """Validate everything and build the prompts, traces and text trackers of a decode
    (``queries`` may be empty: then ``plans`` is empty too).

    Raises:
        TypeError / ValueError: a bad argument, before anything is decoded.
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
        return _Prepared({}, {}, [], [], [], [], speed_of(speed))
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
    llm_pol = get_policy("llm")
    for i, p in enumerate(plans):
        fallback = uses_passages(pol) and not p.has_passages
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
    keyword arguments), and return the (not yet started) decode (:func:`_events`): it takes
    ``lm.lock`` on its first step and releases it when it ends or is closed; with ``cancel``
    it stops (``_Cancelled``) at the first step after ``cancel`` is set."""
    p = _prepare(lm, queries, passages, **kwargs)
    if not p.plans:
        return iter(())
    return _events(lm, p, holder, max_new_tokens=kwargs["max_new_tokens"], cancel=cancel)


def _events(
    lm: LoadedModel, p: _Prepared, holder: list[GenerationResult], *, max_new_tokens: int,
    cancel: threading.Event | None,
) -> Iterator[TokenEvent]:
    """Decode the prepared queries ``p`` to the end, under ``lm.lock`` (taken on the first
    ``next()``, so that an unread stream never blocks other users of the model): each group of
    queries under its policy, one :class:`TokenEvent` per chosen token; at the end, one
    :class:`GenerationResult` per query appended to ``holder``."""
    _acquire(lm.lock, cancel)
    try:
        if cancel is not None and cancel.is_set():
            raise _Cancelled
        for group, idx in p.groups.items():
            timings: dict[str, float] = {}
            t0 = time.perf_counter()
            events = decode_loop(
                lm, [p.plans[i] for i in idx], p.policies[group], max_new_tokens=max_new_tokens,
                stop=p.stops, timings=timings, speed=p.speed,
            )
            for ev in events:
                q = idx[ev.query_idx]
                delta = _record_event(p.traces[q], p.trackers[q], ev)
                if ev.stop_reason != "eos" or delta:
                    yield TokenEvent(q, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step)
                if cancel is not None and cancel.is_set():
                    raise _Cancelled
            total = time.perf_counter() - t0
            for i in idx:
                p.traces[i].timings = {**timings, "total_s": total, "queries_in_batch": float(len(idx))}
    finally:
        lm.lock.release()
    for q, tr in enumerate(p.traces):
        holder.append(_result(tr, p.trackers[q]))


@dataclass
class _Request:
    query: str
    passages: Any
    messages: Any
    rendered: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    cancel: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None
    #: The continuous decode's preparation of this call (:class:`_Prepared`), and the context
    #: rows and longest row it needs (computed once, checked at every step it waits).
    prepared: Any = None
    need: tuple[int, int, int] | None = None
    #: A stream's events, in order: a :class:`TokenEvent` per chosen token, then None once
    #: its result is set (None for a plain call).
    events: queue.SimpleQueue[TokenEvent | None] | None = None


class _Running:
    """The continuous decode of one settings key: the calls waiting to join it."""

    def __init__(self) -> None:
        self.queue: list[_Request] = []


class MicroBatcher:
    """Collects concurrent :meth:`generate` calls on one model into batched decodes.

    ``batches`` counts the batched decodes run and ``batched_calls`` the calls they served
    (for tests and benchmarks; a call decoded alone counts in neither).
    """

    def __init__(
        self,
        lm: LoadedModel,
        wait_s: float = WAIT_S,
        max_batch: int = MAX_BATCH,
        *,
        max_rows: int = MAX_ROWS,
        max_positions: int | None = MAX_POSITIONS,
        continuous: bool = True,
        max_prefill_tokens: int | None = MAX_PREFILL_TOKENS,
    ) -> None:
        self.lm, self.wait_s, self.max_batch = lm, float(wait_s), int(max_batch)
        if int(max_rows) < 1 or (max_positions is not None and int(max_positions) < 1):
            raise ValueError(f"max_rows and max_positions must be >= 1, got {max_rows}, {max_positions}")
        self.max_rows = int(max_rows)
        self.max_positions = None if max_positions is None else int(max_positions)
        if max_prefill_tokens is not None and int(max_prefill_tokens) < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 or None, got {max_prefill_tokens}")
        self.max_prefill_tokens = None if max_prefill_tokens is None else int(max_prefill_tokens)
        self.continuous = require_bool(continuous, "continuous")
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Request]] = {}
        self._running: dict[str, _Running] = {}
        self.batches = 0
        self.batched_calls = 0
        #: Calls that joined a decode already running (continuous batching).
        self.joined_calls = 0
        #: The most context rows one continuous decode held at once.
        self.peak_rows = 0

    @staticmethod
    def _key(kwargs: dict[str, Any]) -> str | None:
        """The settings that must match to share a batch; None = never batch (a Policy
        instance or a value without a stable repr)."""
        policy = kwargs.get("policy", "tokrag")
        if not isinstance(policy, str):
            return None
        items = sorted((k, v) for k, v in kwargs.items() if k not in _PER_CALL)
        try:
            return repr(items)
        except Exception:  # pragma: no cover - defensive: an option without repr
            return None

    def generate(
        self, query: str, passages: Any = None, *, _cancel: threading.Event | None = None, **kwargs: Any
    ) -> GenerationResult:
        """:func:`generate` decoded together with concurrent compatible calls (its input
        checked here, at the call site)."""
        key = self._key(kwargs)
        if key is None:
            return _generate(self.lm, query, passages, cancel=_cancel, **kwargs)
        req = _Request(query, passages, kwargs.get("messages"), kwargs.get("rendered"))
        if _cancel is not None:
            req.cancel = _cancel
        settings = {k: v for k, v in kwargs.items() if k not in _PER_CALL}
        if self.continuous and _continuous_ok(settings):
            req.prepared = _prepare(self.lm, [query], [passages], **_api_kwargs(settings, [req]))
        self._submit(key, req, kwargs)
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def stream(self, query: str, passages: Any = None, *, idle_timeout: float | None = None,
               **kwargs: Any) -> TokenStream:
        """Like :func:`stream` alone (the same arguments and errors, raised here), but the
        stream's query joins the continuous decode of concurrent calls with the same
        settings, plain calls and streams alike. Its events are queued as the shared decode
        chooses them, so a slow reader never holds the others back; a stream closed or
        abandoned (``idle_timeout``) leaves the decode at its next step. Where the rule
        cannot decode continuously, or batching is off, it is decoded alone."""
        key = self._key(kwargs)
        settings = {k: v for k, v in kwargs.items() if k not in _PER_CALL}
        if key is None or not self.continuous or not _continuous_ok(settings):
            return stream(self.lm, query, passages, idle_timeout=idle_timeout, batching=False, **kwargs)
        req = _Request(query, passages, kwargs.get("messages"), kwargs.get("rendered"),
                       events=queue.SimpleQueue())
        # Validated and prompted here, so that a bad input fails at the call site.
        req.prepared = _prepare(self.lm, [query], [passages], **_api_kwargs(settings, [req]))
        holder: list[GenerationResult] = []
        return TokenStream(self._stream_events(key, req, kwargs, holder), holder, stop=req.cancel,
                           idle_timeout=idle_timeout, model_lock=self.lm.lock)

    def _stream_events(self, key: str, req: _Request, kwargs: dict[str, Any],
                       holder: list[GenerationResult]) -> Any:
        """The generator behind :meth:`stream`: submits the call on its first step (an unread
        stream never joins a decode), then hands on its events until its result is set."""
        assert req.events is not None
        try:
            self._submit(key, req, kwargs)
            while True:
                try:
                    item = req.events.get(timeout=0.1)
                except queue.Empty:
                    # An error (or a cancel) ends a call without the None marker; every event
                    # of a finished call is queued before it is marked done.
                    if req.done.is_set() and req.events.empty():
                        break
                    continue
                if item is None:
                    break
                yield item
            if req.error is not None:
                raise req.error
            assert req.result is not None
            holder.append(req.result)
        finally:
            if not req.done.is_set():  # closed early: leave the decode at its next step
                req.cancel.set()

    def _submit(self, key: str, req: _Request, kwargs: dict[str, Any]) -> None:
        """Queue ``req``: into the running decode of ``key``, else into the calls collected
        for the next one; the first of those waits for companions and starts the decode."""
        with self._lock:
            running = self._running.get(key)
            if running is not None:  # a decode with these settings runs: join it
                running.queue.append(req)
                leader = False
            else:
                pending = self._pending.setdefault(key, [])
                pending.append(req)
                leader = len(pending) == 1
        if not leader:
            return
        # Wait while companions keep arriving: up to 10 waits, one quiet wait ends it.
        seen = 0
        for _ in range(10):
            time.sleep(self.wait_s)
            with self._lock:
                n = len(self._pending[key])
            if n == seen or n >= self.max_batch:
                break
            seen = n
        run = _Running()
        with self._lock:
            run.queue = self._pending.pop(key)
            self._running[key] = run  # from now on, calls with this key join the queue
        settings = {k: v for k, v in kwargs.items() if k not in _PER_CALL}
        # The decode runs in a thread of its own: the first call returns when its own
        # answer is done, not when the last call that joined it is.
        thread = threading.Thread(
            target=self._drive, args=(key, run, settings), name="tokrag-decode", daemon=True
        )
        _DECODE_THREADS.add(thread)
        thread.start()

    def _take(self, key: str, run: _Running, n: int | None = None) -> list[_Request]:
        """Up to ``n`` (None: all) queued calls; with none left the decode of ``key`` ends,
        under the same lock, so that a later call starts a new one."""
        with self._lock:
            reqs = run.queue if n is None else run.queue[:n]
            run.queue = [] if n is None else run.queue[n:]
            if not reqs and not run.queue:
                self._running.pop(key, None)
            return reqs

    def _drive(self, key: str, run: _Running, settings: dict[str, Any]) -> None:
        """Decode the calls of ``key`` until none is left: continuously where the rule
        allows it, else batch after batch. Whatever happens, nobody waits forever."""
        seen: list[_Request] = []
        try:
            if self.continuous and _continuous_ok(settings):
                try:
                    _Continuous(self, key, run, settings, seen).run()
                    return
                except Exception as exc:  # noqa: BLE001 - a failed decode: the calls left, one at a time
                    for r in seen:
                        if r.done.is_set():
                            continue
                        if r.events is not None:  # a stream may have sent tokens: not redone
                            r.error = RuntimeError(f"the shared decode this stream was part of failed: {exc}")
                            r.error.__cause__ = exc
                            r.done.set()
                        else:
                            self._decode([r], settings)
            while True:
                reqs = self._take(key, run, self.max_batch)
                if not reqs:
                    return
                seen += reqs
                self._decode(reqs, settings)
        finally:
            with self._lock:
                if self._running.get(key) is run:
                    self._running.pop(key)
                left, run.queue = run.queue, []
            for r in seen + left:
                if not r.done.is_set():
                    r.error = RuntimeError("the batch this call was part of was interrupted")
                    r.done.set()

    def _decode(self, reqs: list[_Request], settings: dict[str, Any]) -> None:
        for r in reqs:
            if r.cancel.is_set():  # cancelled while waiting for its batch: never decoded
                r.error = _Cancelled()
                r.done.set()
        reqs = [r for r in reqs if not r.done.is_set()]
        if len(reqs) > 1:
            try:
                results = _decode_batch(self.lm, reqs, settings)
            except Exception:
                results = None  # one bad input fails the whole batch: answer one at a time
            if results is not None:
                with self._lock:
                    self.batches += 1
                    self.batched_calls += len(reqs)
                for r, res in zip(reqs, results, strict=True):
                    r.result = res
                    r.done.set()
                return
        for r in reqs:
            try:
                r.result = _generate(
                    self.lm, r.query, r.passages, messages=r.messages, rendered=r.rendered,
                    cancel=r.cancel, **settings,
                )
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                r.error = e
            r.done.set()


def _continuous_ok(settings: dict[str, Any]) -> bool:
    """Whether calls with ``settings`` can join a running decode: a step-by-step rule (not
    a :class:`.policies.base.SequencePolicy`) and settings that are all known."""
    if any(k not in _SETTINGS for k in settings):  # an unknown keyword: each call gets its error
        return False
    try:
        pol = get_policy(settings.get("policy", "tokrag"), **dict(settings.get("policy_options") or {}))
        return not isinstance(pol, SequencePolicy)
    except Exception:  # noqa: BLE001 - a bad setting: each call gets its error at its call
        return False


class _Continuous:
    """One continuous decode: queued calls are admitted at step boundaries while they fit
    (``max_rows`` / ``max_positions``), every group's decoder (``main``; ``llm`` for calls
    without usable passages) takes one step, and a call that finishes gets its result."""

    def __init__(
        self, batcher: MicroBatcher, key: str, run: _Running, settings: dict[str, Any], seen: list[_Request]
    ) -> None:
        self.b, self.key, self.run_, self.seen = batcher, key, run, seen
        self.settings = settings
        self.max_new_tokens = int(_api_kwargs(settings, [])["max_new_tokens"])
        self.decoders: dict[str, Decoder] = {}
        #: group -> query id -> the call, its trace and text tracker, its timings so far, and
        #: when its admission and its decode started (perf_counter).
        self.owners: dict[str, dict[int, tuple[_Request, Any, Any, dict[str, float], float, float]]] = {}
        self.served = 0

    def _prepare(self, r: _Request) -> Any:
        return _prepare(self.b.lm, [r.query], [r.passages], **_api_kwargs(self.settings, [r]))

    def _rows(self) -> tuple[int, int]:
        """Context rows held and the longest row, over every group's decoder."""
        rows = sum(d.rows_in_use() for d in self.decoders.values())
        return rows, max((d.width() for d in self.decoders.values()), default=0)

    def _active(self) -> int:
        return sum(len(d.active) for d in self.decoders.values())

    def _admit(self) -> None:
        """Admit the queued calls that fit, first come first served; the rest wait."""
        with self.b._lock:
            queued, self.run_.queue = self.run_.queue, []
        self.seen += queued
        waiting: list[_Request] = []
        prefilled = 0  # prompt tokens admitted at this boundary
        budget = self.b.max_prefill_tokens
        for r in queued:
            if waiting:  # keep the order: nobody overtakes a call that did not fit
                waiting.append(r)
                continue
            if r.cancel.is_set():
                r.error = _Cancelled()
                r.done.set()
                continue
            try:
                if r.prepared is None:
                    r.prepared = self._prepare(r)
                if r.need is None:
                    r.need = self._need(r.prepared)
            except Exception as e:  # noqa: BLE001 - a bad input: this call's error only
                r.error = e
                r.done.set()
                continue
            if not self._fits(r.need) or (
                budget is not None and prefilled > 0 and prefilled + r.need[2] > budget
            ):
                waiting.append(r)
                continue
            prefilled += r.need[2]
            self._start(r, r.prepared)
        if waiting:
            with self.b._lock:
                self.run_.queue = waiting + self.run_.queue

    def _need(self, p: Any) -> tuple[int, int, int]:
        """The context rows a prepared call adds, its longest context and its prompt tokens
        (positions)."""
        (group,) = p.groups
        pol = p.policies[group]
        pol.prepare(self.b.lm)
        contexts = pol.contexts(p.plans[0])
        lengths = [len(c.ids) for c in contexts.values()]
        return len(lengths), max(lengths), sum(lengths)

    def _fits(self, need: tuple[int, int, int]) -> bool:
        rows, width = self._rows()
        if rows == 0:
            return True  # an empty decode takes any call, however large
        total = rows + need[0]
        if total > self.b.max_rows:
            return False
        cap = self.b.max_positions
        return cap is None or total * (max(width, need[1]) + self.max_new_tokens) <= cap

    def _start(self, r: _Request, p: Any) -> None:
        (group,) = p.groups
        d = self.decoders.get(group)
        if d is None:
            d = self.decoders[group] = Decoder(
                self.b.lm, p.policies[group], max_new_tokens=self.max_new_tokens, stop=p.stops, speed=p.speed
            )
            self.owners[group] = {}
        joined = self._active() > 0
        t0 = time.perf_counter()
        (q,) = d.admit(p.plans)
        now = time.perf_counter()
        timings = {
            "prefill_s": now - t0,
            "fused": d.timings.get("fused", 0.0),
            "packed": d.timings.get("packed", 0.0),
            "joined": float(joined),
            "queries_in_batch": 0.0,
        }
        self.owners[group][q] = (r, p.traces[0], p.trackers[0], timings, t0, now)
        self.served += 1
        with self.b._lock:  # counted now: a call may return before the decode ends
            self.b.joined_calls += int(joined)
            if self.served == 2:  # a second call makes this decode a batch
                self.b.batches += 1
            self.b.batched_calls += 2 if self.served == 2 else int(self.served > 2)

    def _step(self) -> None:
        n_active = self._active()
        rows, _ = self._rows()
        with self.b._lock:
            self.b.peak_rows = max(self.b.peak_rows, rows)
        for group, d in self.decoders.items():
            owners = self.owners[group]
            for q in d.active:
                r = owners[q][0]
                if r.cancel.is_set():  # leaves the batch; the others go on
                    d.cancel(q)
                    r.error = _Cancelled()
                    r.done.set()
            if not d.active:
                continue
            for ev in d.choose():
                r, trace, tracker, t, t0, t1 = owners[ev.query_idx]
                t["queries_in_batch"] = max(t["queries_in_batch"], float(n_active))
                delta = _record_event(trace, tracker, ev)
                if r.events is not None and (ev.stop_reason != "eos" or delta):
                    r.events.put(TokenEvent(0, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step))
                if ev.finished:
                    end = time.perf_counter()
                    trace.timings = {**t, "decode_s": end - t1, "total_s": end - t0}
                    r.result = _result(trace, tracker)
                    r.done.set()
                    if r.events is not None:
                        r.events.put(None)
        for d in self.decoders.values():
            d.advance()

    def _idle_end(self) -> bool:
        """With nothing decoding: end the decode if no call waits (under the batcher's lock,
        so that a later call starts a new one), else go on."""
        with self.b._lock:
            if self.run_.queue:
                return False
            if self.b._running.get(self.key) is self.run_:
                self.b._running.pop(self.key)
            return True

    def run(self) -> None:
        lm = self.b.lm
        _acquire(lm.lock, None)
        try:
            while True:
                self._admit()
                if self._active():
                    self._step()
                elif self._idle_end():
                    break
        finally:
            lm.lock.release()


def _api_kwargs(settings: dict[str, Any], reqs: list[_Request]) -> dict[str, Any]:
    """The keywords of :func:`_prepare` / :func:`_run` for ``reqs`` decoded under
    ``settings`` (the entry point's defaults where a setting was not given)."""
    messages = [r.messages for r in reqs]
    rendered = [r.rendered for r in reqs]
    return {
        "policy": settings.get("policy", "tokrag"),
        "policy_options": settings.get("policy_options"),
        "speed": settings.get("speed"),
        "prompt_format": settings.get("prompt_format", "qa"),
        "max_new_tokens": settings.get("max_new_tokens", MAX_NEW_TOKENS),
        "stop": settings.get("stop"),
        "messages": messages if any(messages) else None,
        "system_prompt": settings.get("system_prompt", _DEFAULT),
        "max_context_tokens": settings.get("max_context_tokens"),
        "rendered": rendered if any(r is not None for r in rendered) else None,
    }


def _decode_batch(lm: LoadedModel, reqs: list[_Request], settings: dict[str, Any]) -> list[GenerationResult]:
    holder: list[GenerationResult] = []
    for _ in _run(
        lm, [r.query for r in reqs], [r.passages for r in reqs], holder=holder, **_api_kwargs(settings, reqs)
    ):
        pass
    return holder


_BATCHERS_LOCK = threading.Lock()

#: Decode threads that may still be running (see :func:`_join_decodes_at_exit`).
_DECODE_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _join_decodes_at_exit() -> None:
    """Wait for the decode threads before the interpreter shuts down. A call returns as soon
    as its own answer is done, while its decode thread still finishes that step; a daemon
    thread still inside a torch kernel at finalization aborts the process ("terminate called
    without an active exception"), as :func:`.streams._stop_streams_at_exit` explains."""
    for thread in list(_DECODE_THREADS):
        thread.join(timeout=60)


def batcher_for(lm: LoadedModel) -> MicroBatcher:
    """The model's shared batcher (one per loaded model, kept on the model handle)."""
    if not isinstance(lm, LoadedModel):
        raise TypeError("the first argument must be a LoadedModel from tokrag_integrations.load_model()")
    with _BATCHERS_LOCK:
        b = lm.__dict__.get("_micro_batcher")
        if b is None:
            b = lm.__dict__["_micro_batcher"] = MicroBatcher(lm)
        return b



# ---------------------------------------------------------------------- entry points
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
    batching: bool = False,
) -> GenerationResult:
    """Answer ``query`` with ``passages`` (ranked, best first) under a decoding ``policy``.

    Args:
        lm: from :func:`tokrag_integrations.load_model`.
        query: the question (the content of the final user turn).
        passages: a list of strings, :class:`Passage` objects or (text, score) pairs; empty
            or None answers from the pure context and records that in the trace.
        policy: ``"tokrag"`` (default), ``"rag"``, ``"llm"``... or a Policy instance.
        policy_options: the policy's options (e.g. ``{"pr_norm": "softmax"}``), checked by
            :func:`.policies.get_policy`.
        speed: how fast, never what is decided: a :class:`.engine.speed.Speed`, a preset
            (``"auto"``, the default; ``"reference"``, the step-by-step loop as written) or a
            dict of its fields (``{"fuse": False}``).
        max_new_tokens / stop: stopping rules (EOS always stops).
        messages: earlier chat turns (role/content dicts) placed before the question.
        system_prompt: override the builder's default system prompt (None = no system turn).
        max_context_tokens: a tighter context budget than the model's window.
        prompt_format: ``"chat"``/``"text"`` (without passages: the query as the raw user
            turn or the exact prompt, no default system prompt; see ``PromptBuilder.build``).
        rendered: a ``RenderedPrompt`` instead of ``passages``: the RAG context is the
            caller's own formatted prompt and its retrieved tokens are where its context
            variable landed (the framework adapters' path; see ``PromptBuilder.build_rendered``).
        batching: True: decode together with concurrent calls on ``lm`` (the module
            docstring); False (default): alone, in the calling thread, holding ``lm.lock``.

    Raises:
        TypeError / ValueError: a bad argument (checked before anything is decoded).
    """
    kwargs = dict(
        policy=policy, policy_options=policy_options, speed=speed, max_new_tokens=max_new_tokens,
        stop=stop, messages=messages, system_prompt=system_prompt,
        max_context_tokens=max_context_tokens, prompt_format=prompt_format, rendered=rendered,
    )
    if not require_bool(batching, "batching"):
        return _generate(lm, query, passages, **kwargs)
    return batcher_for(lm).generate(query, passages, **kwargs)


def _generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    messages: list[dict[str, str]] | None = None,
    rendered: RenderedPrompt | None = None,
    cancel: threading.Event | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """One call decoded alone (the other keywords: :func:`_prepare`'s, with their defaults
    from :func:`_api_kwargs`)."""
    _check_keywords(kwargs)
    holder: list[GenerationResult] = []
    settings = _api_kwargs(kwargs, [])
    settings.update(messages=[messages] if messages else None, rendered=None if rendered is None else [rendered])
    for _ in _run(lm, [query], [passages], holder=holder, cancel=cancel, **settings):
        pass
    return holder[0]


def stream(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    idle_timeout: float | None = None,
    batching: bool = False,
    **kwargs: Any,
) -> TokenStream:
    """Like :func:`generate` (the same keyword arguments) but yields a :class:`TokenEvent`
    per chosen token as it is chosen.

    Validation (empty query, unknown policy, bad arguments, prompt too long) happens here,
    before the first token, so errors surface at the call site.

    The returned :class:`TokenStream` may be read from any thread. It holds the model from its
    first ``next()`` until it is exhausted, closed, garbage collected or abandoned: once
    started, a stream nobody reads for ``idle_timeout`` seconds (default
    ``$TOKRAG_STREAM_IDLE_TIMEOUT`` or 30) is closed to free the model, and reading it again
    raises :class:`StreamAbandoned`. Use ``with stream(...) as s:`` or ``s.close()`` to stop
    early.
    """
    timeout = idle_timeout_from(idle_timeout)
    if require_bool(batching, "batching"):
        return batcher_for(lm).stream(query, passages, idle_timeout=timeout, **kwargs)
    _check_keywords(kwargs)
    holder: list[GenerationResult] = []
    stop_event = threading.Event()
    settings = _api_kwargs(kwargs, [])
    messages, rendered = kwargs.get("messages"), kwargs.get("rendered")
    settings.update(messages=[messages] if messages else None, rendered=None if rendered is None else [rendered])
    gen = _run(lm, [query], [passages], holder=holder, cancel=stop_event, **settings)
    return TokenStream(gen, holder, stop=stop_event, idle_timeout=timeout, model_lock=lm.lock)


def _check_keywords(kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword no entry point takes (the message names the known ones)."""
    unknown = sorted(set(kwargs) - set(_SETTINGS) - set(_PER_CALL))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument {unknown[0]!r}; policy options go in "
            f"policy_options={{...}}; keywords: {', '.join(_SETTINGS + _PER_CALL)}"
        )


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
) -> list[GenerationResult]:
    """Decode several queries as one batch (one forward pass per context role per step),
    in the calling thread; the arguments are those of :func:`generate`.

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
        lm, list(queries), plist, holder=holder, policy=policy, policy_options=policy_options,
        speed=speed, max_new_tokens=max_new_tokens, stop=stop, messages=None,
        system_prompt=system_prompt, max_context_tokens=max_context_tokens,
        prompt_format=prompt_format,
    ):
        pass
    return holder


async def agenerate(
    lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, *, batching: bool = False, **kwargs: Any
) -> GenerationResult:
    """Async :func:`generate`: the model runs in a worker thread, never on the event loop.

    Cancelling the task stops the decode at its next step (or while it waits for the model);
    a cancelled call that shares a batch is dropped while the batch goes on for the others.
    The cancellation is re-raised once the worker has let go of the model.
    """
    if not require_bool(batching, "batching"):
        return await run_cancellable(lambda cancel: _generate(lm, query, passages, cancel=cancel, **kwargs))
    batcher = batcher_for(lm)
    return await run_cancellable(lambda cancel: batcher.generate(query, passages, _cancel=cancel, **kwargs))


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
