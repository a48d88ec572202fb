"""The one scheduler, and the entry points that use it: :func:`generate`, :func:`stream`,
:func:`generate_batch`, :func:`agenerate`, :func:`astream`, :func:`astream_with_result` (the
package root exports them; the framework adapters and the server call them). Every call,
whatever its rule, is decoded by one step loop (:class:`_Loop`) on the engine's decoders
(:class:`.engine.decoder.Decoder`; :class:`.loop.SequenceDecoder` for a sequence-level rule).

``batching=True`` (what the framework adapters and the server use): the first call with a
given set of settings (policy, its options, speed, max_new_tokens, stop, system prompt,
budget) waits ``wait_s`` for companions, then decodes them together in a thread of its own;
until that decode ends, a call with the same settings joins it at the next step boundary
(iteration-level scheduling, Orca, OSDI 2022), and a finished call leaves at once with its
result. ``max_rows`` (context rows: two per Tok-RAG query) and ``max_positions`` (rows times
key/value positions) bound the memory, a call that does not fit waits; ``max_prefill_tokens``
bounds what one step boundary prefills; with ``continuous=False`` a call waits for the running
decode to end and joins the next one (``max_batch`` calls at most). Every call gets the tokens
and decisions it gets alone (tests/integration/test_batching.py); a bad input fails its own
call, at the call site. ``batching=False`` (the default, and :func:`generate_batch`): the
given queries decoded alone, in the calling thread, holding ``lm.lock`` (one decode at a time
per model; other threads wait).
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
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
from ..speed import Speed, speed_of
from ..trace import Trace
from .decoder import Decoder, StepEvent
from .loop import SequenceDecoder, decoder_for
from .seam import speed_paths_off
from .streams import (
    _END,
    DECODE_THREADS,
    TokenStream,
    _acquire,
    _Cancelled,
    idle_timeout_from,
    run_cancellable,
)

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

#: Default wait for companions (seconds) and largest batch of ``continuous=False``.
WAIT_S = 0.01
MAX_BATCH = 16
#: Default bounds of a decode: context rows (two per Tok-RAG query), and key/value
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
    "citations",
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
    max_new_tokens: int
    citations: bool | None = False


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
    trackers = [_TextTracker(lm.tokenizer, stops) for _ in queries]

    return _Prepared(
        {"main": pol, "llm": llm_pol},
        groups,
        plans,
        traces,
        trackers,
        stops,
        chosen_speed,
        max_new_tokens,
        None if citations is None else require_bool(citations, "citations"),
    )


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


class _Loop:
    """The one step loop of the scheduler: queued calls are admitted at step boundaries,
    every group's decoder (``main``; ``llm`` for queries without usable passages) chooses and
    advances one step, and a call whose queries are all finished gets its results.

    With a ``batcher``, calls are admitted while they fit its bounds (``max_rows`` /
    ``max_positions`` / ``max_prefill_tokens``; with ``continuous=False`` only into an empty
    decode, ``max_batch`` at a time). Without one, the loop of a call decoded alone.
    """

    def __init__(
        self, lm: LoadedModel, max_new_tokens: int, batcher: MicroBatcher | None = None
    ) -> None:
        self.lm, self.max_new_tokens, self.b = lm, max_new_tokens, batcher
        self.queue: list[_Request] = []
        self.seen: list[_Request] = []
        self.decoders: dict[str, Decoder | SequenceDecoder] = {}
        self.owners: dict[str, dict[int, _Query]] = {}
        self.served = 0
        #: Context rows held at the last step (read by :meth:`MicroBatcher.running_rows`).
        self.rows = 0

    def _rows(self) -> tuple[int, int]:
        """Context rows held and the longest row, over every group's decoder."""
        rows = sum(d.rows_in_use() for d in self.decoders.values())
        return rows, max((d.width() for d in self.decoders.values()), default=0)

    def _room(self) -> int | None:
        """Context rows the decode may still take (None: no bound, a call decoded alone)."""
        return None if self.b is None else max(0, self.b.max_rows - self._rows()[0])

    def _active(self) -> int:
        return sum(len(d.active) for d in self.decoders.values())

    def _admit(self) -> None:
        """Admit the queued calls that fit, first come first served; the rest wait."""
        b = self.b
        assert b is not None
        with b._lock:
            queued, self.queue = self.queue, []
        waiting: list[_Request] = []
        prefilled = started = 0  # prompt tokens and calls admitted at this boundary
        budget = b.max_prefill_tokens
        room = None if b.continuous else 0 if self._active() else b.max_batch
        for r in queued:
            if waiting or (room is not None and started >= room):  # nobody overtakes
                waiting.append(r)
                continue
            if r.cancel.is_set():
                r.fail(_Cancelled())
                continue
            try:
                if r.need is None:
                    r.need = self._need(r.prepared)
            except Exception as e:  # noqa: BLE001 - a bad input: this call's error only
                r.fail(e)
                continue
            if not self._fits(r.need) or (
                budget is not None and prefilled > 0 and prefilled + r.need[2] > budget
            ):
                waiting.append(r)
                continue
            prefilled += r.need[2]
            started += 1
            self._start(r)
        if waiting:
            with b._lock:
                self.queue = waiting + self.queue

    def _need(self, p: _Prepared) -> tuple[int, int, int]:
        """The context rows a prepared call adds, its longest context and its prompt tokens
        (positions)."""
        lengths = []
        for group, idx in p.groups.items():
            pol = p.policies[group]
            pol.prepare(self.lm)
            lengths += [len(c.ids) for i in idx for c in pol.contexts(p.plans[i]).values()]
        return len(lengths), max(lengths), sum(lengths)

    def _fits(self, need: tuple[int, int, int]) -> bool:
        assert self.b is not None
        rows, width = self._rows()
        if rows == 0:
            return True  # an empty decode takes any call, however large
        total = rows + need[0]
        if total > self.b.max_rows:
            return False
        cap = self.b.max_positions
        return cap is None or total * (max(width, need[1]) + self.max_new_tokens) <= cap

    def _start(self, r: _Request) -> None:
        """Prefill the call's queries, each group's in one admission."""
        p = r.prepared
        joined = float(self._active() > 0)
        self.seen.append(r)
        r.results = [None] * len(p.plans)
        for group, idx in p.groups.items():
            d = self.decoders.get(group)
            if d is None:
                d = self.decoders[group] = decoder_for(
                    self.lm,
                    p.policies[group],
                    max_new_tokens=p.max_new_tokens,
                    stop=p.stops,
                    speed=p.speed,
                    citations=p.citations,
                    room=self._room,
                )
                self.owners[group] = {}
            t0 = time.perf_counter()
            ids = d.admit([p.plans[i] for i in idx])
            now = time.perf_counter()
            static_off = getattr(d, "static_off", None)
            for q, i in zip(ids, idx, strict=True):
                timings = {**d.timings, "joined": joined, "queries_in_batch": 0.0}
                self.owners[group][q] = _Query(
                    r, i, p.traces[i], p.trackers[i], timings, t0, now, static_off
                )
                r.queries.append(self.owners[group][q])
        if self.b is None:
            return
        self.served += 1
        with self.b._lock:  # counted now: a call may return before the decode ends
            self.b.joined_calls += int(joined)
            if self.served == 2:  # a second call makes this decode a batch
                self.b.batches += 1
            self.b.batched_calls += 2 if self.served == 2 else int(self.served > 2)

    def _step(self) -> None:
        n_active = self._active()
        if self.b is not None:
            self.rows, _ = self._rows()
            with self.b._lock:
                self.b.peak_rows = max(self.b.peak_rows, self.rows)
        for group, d in self.decoders.items():
            owners = self.owners[group]
            for q in d.active:
                if owners[q].r.cancel.is_set():  # leaves the batch; the others go on
                    r = owners.pop(q).r
                    d.cancel(q)
                    if not r.done.is_set():
                        r.fail(_Cancelled())
            if not d.active:
                continue
            for ev in d.choose():
                o = owners.pop(ev.query_idx) if ev.finished else owners[ev.query_idx]
                o.timings["queries_in_batch"] = max(o.timings["queries_in_batch"], float(n_active))
                self._record(o, ev)
        for d in self.decoders.values():
            d.advance()

    def _record(self, o: _Query, ev: StepEvent) -> None:
        """Add a decode event to its query's trace and text, hand it to its call's events;
        a call whose queries are all finished gets its results."""
        r, is_eos = o.r, ev.stop_reason == "eos"
        if not is_eos:
            o.trace.steps.append(ev.step)
        delta = o.tracker.push(None if is_eos else ev.step.token_id, ev.finished)
        if r.events is not None and (not is_eos or delta):
            r.events.put(
                TokenEvent(o.i, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step)
            )
        if not ev.finished:
            return
        o.trace.stop_reason = ev.stop_reason
        o.trace.text = o.tracker.final if o.tracker.final is not None else o.tracker.text()
        r.results[o.i] = GenerationResult(
            text=o.trace.text, trace=o.trace, token_ids=list(o.tracker.ids)
        )
        if any(x is None for x in r.results):
            return
        end = time.perf_counter()  # the call's queries are timed to its end
        # The paths off for this decode (its Speed), after its own measurements.
        off = speed_paths_off(self.lm, r.prepared.speed)
        for x in r.queries:
            x.trace.timings = {**x.timings, "decode_s": end - x.t1, "total_s": end - x.t0}
            static = {"static": x.static_off} if x.static_off else {}
            x.trace.speed["speed_paths_off"] = {**off, **static}
        r.done.set()
        if r.events is not None:
            r.events.put(None)

    def run(self) -> None:
        """Decode until no call is left (under ``lm.lock``)."""
        _acquire(self.lm.lock, None)
        try:
            while True:
                self._admit()
                if self._active():
                    self._step()
                elif self._idle_end():
                    break
        finally:
            self.lm.lock.release()

    def _idle_end(self) -> bool:
        """With nothing decoding: end the decode if no call waits (under the batcher's lock,
        so that a later call starts a new one), else go on."""
        assert self.b is not None
        with self.b._lock:
            if self.queue:
                return False
            for key, running in list(self.b._running.items()):
                if running is self:
                    self.b._running.pop(key)
            return True


def _alone(lm: LoadedModel, r: _Request, holder: list[GenerationResult]) -> Iterator[TokenEvent]:
    """Decode the call ``r`` alone, in the calling thread, under ``lm.lock`` (taken on the
    first ``next()``, so that an unread stream never blocks other users of the model), one
    :class:`TokenEvent` per chosen token; at the end its results are appended to ``holder``.
    It stops (``_Cancelled``) at the first step after ``r.cancel`` is set."""
    r.events = queue.SimpleQueue()
    loop = _Loop(lm, r.prepared.max_new_tokens)
    _acquire(lm.lock, r.cancel)
    try:
        if r.cancel.is_set():
            raise _Cancelled
        loop._start(r)
        while loop._active():
            loop._step()
            while not r.events.empty():
                item = r.events.get()
                if item is not None:
                    yield item
            if r.error is not None:
                raise r.error
    finally:
        lm.lock.release()
    holder.extend(x for x in r.results if x is not None)


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
            raise ValueError(
                f"max_rows and max_positions must be >= 1, got {max_rows}, {max_positions}"
            )
        self.max_rows = int(max_rows)
        self.max_positions = None if max_positions is None else int(max_positions)
        if max_prefill_tokens is not None and int(max_prefill_tokens) < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1 or None, got {max_prefill_tokens}")
        self.max_prefill_tokens = None if max_prefill_tokens is None else int(max_prefill_tokens)
        self.continuous = require_bool(continuous, "continuous")
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Request]] = {}
        self._running: dict[str, _Loop] = {}
        self.batches = 0
        self.batched_calls = 0
        #: Calls that joined a decode already running (continuous batching).
        self.joined_calls = 0
        #: The most context rows one decode held at once.
        self.peak_rows = 0

    def waiting(self) -> int:
        """Calls queued and not admitted to a decode yet (collected for the next decode, or
        waiting for rows of a running one)."""
        with self._lock:
            return sum(map(len, self._pending.values())) + sum(
                len(loop.queue) for loop in self._running.values()
            )

    def running_rows(self) -> int:
        """Context rows the running decodes held at their last step."""
        with self._lock:
            return sum(loop.rows for loop in self._running.values())

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
        self,
        query: str,
        passages: Any = None,
        *,
        _cancel: threading.Event | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """:func:`generate` decoded together with concurrent compatible calls (its input
        checked here, at the call site)."""
        key = self._key(kwargs)
        if key is None:
            return _generate(self.lm, query, passages, cancel=_cancel, **kwargs)
        r = _request(self.lm, query, passages, kwargs)
        if _cancel is not None:
            r.cancel = _cancel
        r.alone = functools.partial(_generate, self.lm, query, passages, cancel=r.cancel, **kwargs)
        self._submit(key, r)
        r.done.wait()
        if r.error is not None:
            raise r.error
        assert r.results[0] is not None
        return r.results[0]

    def stream(
        self, query: str, passages: Any = None, *, idle_timeout: float | None = None, **kwargs: Any
    ) -> TokenStream:
        """Like :func:`stream` alone (the same arguments and errors, raised here), but the
        stream's query joins the decode of concurrent calls with the same settings, plain
        calls and streams alike. Its events are queued as the shared decode chooses them, so
        a slow reader never holds the others back; a stream closed or abandoned
        (``idle_timeout``) leaves the decode at its next step."""
        key = self._key(kwargs)
        if key is None:
            return stream(self.lm, query, passages, idle_timeout=idle_timeout, **kwargs)
        r = _request(self.lm, query, passages, kwargs)
        r.events = queue.SimpleQueue()
        holder: list[GenerationResult] = []
        gen = self._stream_events(key, r, holder)
        return TokenStream(
            gen, holder, stop=r.cancel, idle_timeout=idle_timeout, model_lock=self.lm.lock
        )

    def _stream_events(
        self, key: str, req: _Request, holder: list[GenerationResult]
    ) -> Iterator[TokenEvent]:
        """The generator behind :meth:`stream`: submits the call on its first step (an unread
        stream never joins a decode), then hands on its events until its result is set."""
        assert req.events is not None
        try:
            self._submit(key, req)
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
            holder.extend(x for x in req.results if x is not None)
        finally:
            if not req.done.is_set():  # closed early: leave the decode at its next step
                req.cancel.set()

    def _submit(self, key: str, req: _Request) -> None:
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
        loop = _Loop(self.lm, req.prepared.max_new_tokens, self)
        with self._lock:
            loop.queue = self._pending.pop(key)
            self._running[key] = loop  # from now on, calls with this key join the queue
        # The decode runs in a thread of its own: the first call returns when its own
        # answer is done, not when the last call that joined it is.
        thread = threading.Thread(
            target=self._drive, args=(key, loop), name="tokrag-decode", daemon=True
        )
        DECODE_THREADS.add(thread)
        thread.start()

    def _drive(self, key: str, loop: _Loop) -> None:
        """Run the decode of ``key``; should it fail, its plain calls are decoded again one
        at a time, its streams get the error. Whatever happens, nobody waits forever."""
        failed: Exception | None = None
        try:
            loop.run()
        except Exception as exc:  # noqa: BLE001 - a failed decode: the calls left, one at a time
            failed = exc
        finally:
            with self._lock:
                if self._running.get(key) is loop:
                    self._running.pop(key)
                left, loop.queue = loop.queue, []
            for r in loop.seen + left:
                if r.done.is_set():
                    continue
                if failed is None:
                    r.fail(RuntimeError("the batch this call was part of was interrupted"))
                elif r.events is not None or r.alone is None:  # a stream may have sent tokens
                    error = RuntimeError(
                        f"the shared decode this stream was part of failed: {failed}"
                    )
                    error.__cause__ = failed
                    r.fail(error)
                else:
                    try:
                        r.results = [r.alone()]
                    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                        r.error = e
                    r.done.set()


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


_BATCHERS_LOCK = threading.Lock()


def batcher_for(lm: LoadedModel) -> MicroBatcher:
    """The model's shared batcher (one per loaded model, kept on the model handle)."""
    if not isinstance(lm, LoadedModel):
        raise TypeError(
            "the first argument must be a LoadedModel from tokrag_integrations.load_model()"
        )
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
    citations: bool | None = CITATIONS,
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
        speed: how fast, never what is decided: a :class:`.speed.Speed`, a preset
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
        citations: record at every step each passage's share of the RAG context's attention
            (:meth:`.trace.Trace.citations`): None (default) where the policy reads that
            context's layers anyway (``tokrag``, ``tokrag_reference``), True for every policy
            with a ``rag`` context (it is then probed: ``rag``, ``cad``...), False never.
            Steps without a ``rag`` context (``llm``, ``rag_token``, ``rag_sequence``) carry
            none.

    Raises:
        TypeError / ValueError: a bad argument (checked before anything is decoded).
    """
    kwargs = dict(
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
        citations=citations,
    )
    if not require_bool(batching, "batching"):
        return _generate(lm, query, passages, **kwargs)
    return batcher_for(lm).generate(query, passages, **kwargs)


def _generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    cancel: threading.Event | None = None,
    **kwargs: Any,
) -> GenerationResult:
    """One call decoded alone (the other keywords: :func:`generate`'s)."""
    r = _request(lm, query, passages, kwargs)
    if cancel is not None:
        r.cancel = cancel
    holder: list[GenerationResult] = []
    for _ in _alone(lm, r, holder):
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
    r = _request(lm, query, passages, kwargs)
    holder: list[GenerationResult] = []
    return TokenStream(
        _alone(lm, r, holder), holder, stop=r.cancel, idle_timeout=timeout, model_lock=lm.lock
    )


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
    citations: bool | None = CITATIONS,
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
    if passages is not None and (
        isinstance(passages, (str, bytes)) or not isinstance(passages, Sequence)
    ):
        raise TypeError(
            f"passages must be a list with one list of passages per query, got a {type(passages).__name__}"
        )
    plist = list(passages) if passages is not None else [None] * len(queries)
    p = _prepare(
        lm,
        list(queries),
        plist,
        policy=policy,
        policy_options=policy_options,
        speed=speed,
        max_new_tokens=max_new_tokens,
        stop=stop,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        prompt_format=prompt_format,
        citations=citations,
    )
    holder: list[GenerationResult] = []
    if p.plans:
        for _ in _alone(lm, _Request(p), holder):
            pass
    return holder


async def agenerate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    batching: bool = False,
    **kwargs: Any,
) -> GenerationResult:
    """Async :func:`generate`: the model runs in a worker thread, never on the event loop.

    Cancelling the task stops the decode at its next step (or while it waits for the model);
    a cancelled call that shares a batch is dropped while the batch goes on for the others.
    The cancellation is re-raised once the worker has let go of the model.
    """
    if not require_bool(batching, "batching"):
        return await run_cancellable(
            lambda cancel: _generate(lm, query, passages, cancel=cancel, **kwargs)
        )
    batcher = batcher_for(lm)
    return await run_cancellable(
        lambda cancel: batcher.generate(query, passages, _cancel=cancel, **kwargs)
    )


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


async def _aiterate(
    open_stream: Callable[[], TokenStream],
) -> AsyncIterator[TokenEvent | GenerationResult]:
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
