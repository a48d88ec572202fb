"""Micro-batching of concurrent calls, continuous: calls share one decode, and a call that
arrives while a decode runs joins it at the next step.

The framework adapters answer concurrent calls (LangChain ``batch``/``abatch``, LlamaIndex
``asyncio.gather`` over ``acomplete``, the HTTP server) through :func:`generate`. The first
call with a given set of decoding settings waits ``wait_s`` for others with the same
settings, then decodes all of them together (one forward pass per step for all their
contexts), in a thread of its own. Until that decode ends, a call with the same settings joins it at the next step
boundary (Orca's iteration-level scheduling, Yu et al., OSDI 2022): it is prefilled on its
own and its rows are merged into the running batch (:class:`.engine.decoder.Decoder`). A
finished call leaves at once and returns its result, the first call included; the others
go on. ``max_rows`` (context
rows: two per Tok-RAG query, one per RAG query) and ``max_positions`` (rows times key/value
positions the merged batch can reach) bound the memory: a call that does not fit waits for
rows to free up; ``max_prefill_tokens`` (no bound by default) what is prefilled at one step
boundary, so that a burst of calls joins over several steps. Calls with different settings (policy, its options, max_new_tokens, stop,
system prompt, budget) never share a decode. A stream (:meth:`MicroBatcher.stream`) joins
like any call, its tokens handed on as they are chosen. Every call gets the
tokens and decisions it gets alone (tests/integration/test_batching.py checks it on the
packaged model).

A call whose input is bad gets its error; the others are not affected. Rules that cannot
take queries mid-decode (sequence-level rules, blockwise verification) decode the calls
collected together as one batch; calls arriving meanwhile form the next one.
"""

from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from . import api
from .api import GenerationResult
from .config import require_bool
from .defaults import MAX_NEW_TOKENS
from .engine.decoder import Decoder
from .models import LoadedModel
from .policies import get_policy
from .results import TokenEvent
from .runner import continuous_supported, decoder
from .streams import TokenStream

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
    #: The continuous decode's preparation of this call (``api._Prepared``), and the context
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
        """Like :func:`api.generate`, decoded together with concurrent compatible calls."""
        key = self._key(kwargs)
        if key is None:
            return api._generate(self.lm, query, passages, cancel=_cancel, **kwargs)
        req = _Request(query, passages, kwargs.get("messages"), kwargs.get("rendered"))
        if _cancel is not None:
            req.cancel = _cancel
        self._submit(key, req, kwargs)
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def stream(self, query: str, passages: Any = None, *, idle_timeout: float | None = None,
               **kwargs: Any) -> TokenStream:
        """Like :func:`api.stream` (the same arguments and errors, raised here), but the
        stream's query joins the continuous decode of concurrent calls with the same
        settings, plain calls and streams alike. Its events are queued as the shared decode
        chooses them, so a slow reader never holds the others back; a stream closed or
        abandoned (``idle_timeout``) leaves the decode at its next step. Where the rule
        cannot decode continuously, or batching is off, it is :func:`api.stream`."""
        key = self._key(kwargs)
        settings = {k: v for k, v in kwargs.items() if k not in _PER_CALL}
        if key is None or not self.continuous or not _continuous_ok(settings):
            return api.stream(self.lm, query, passages, idle_timeout=idle_timeout, **kwargs)
        req = _Request(query, passages, kwargs.get("messages"), kwargs.get("rendered"),
                       events=queue.SimpleQueue())
        # Validated and prompted here, so that a bad input fails at the call site.
        req.prepared = api._prepare(
            self.lm, [query], [passages], caller="stream", **_api_kwargs(settings, [req])
        )
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
                r.error = api._Cancelled()
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
                r.result = api._generate(
                    self.lm, r.query, r.passages, messages=r.messages, rendered=r.rendered,
                    cancel=r.cancel, **settings,
                )
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                r.error = e
            r.done.set()


def _continuous_ok(settings: dict[str, Any]) -> bool:
    """Whether calls with ``settings`` can join a running decode: a step-by-step rule
    (:func:`.runner.continuous_supported`) given its options the current way."""
    if any(k not in _SETTINGS for k in settings):  # deprecated **options: batch by batch
        return False
    try:
        pol = get_policy(settings.get("policy", "tokrag"), **dict(settings.get("policy_options") or {}))
        return continuous_supported(pol, settings.get("speed"))
    except Exception:  # noqa: BLE001 - a bad setting: each call gets its error the old way
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
        return api._prepare(
            self.b.lm, [r.query], [r.passages], caller="generate", **_api_kwargs(self.settings, [r])
        )

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
                r.error = api._Cancelled()
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
            d = self.decoders[group] = decoder(
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
                    r.error = api._Cancelled()
                    r.done.set()
            if not d.active:
                continue
            for ev in d.choose():
                r, trace, tracker, t, t0, t1 = owners[ev.query_idx]
                t["queries_in_batch"] = max(t["queries_in_batch"], float(n_active))
                delta = api._record_event(trace, tracker, ev)
                if r.events is not None and (ev.stop_reason != "eos" or delta):
                    r.events.put(TokenEvent(0, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step))
                if ev.finished:
                    end = time.perf_counter()
                    trace.timings = {**t, "decode_s": end - t1, "total_s": end - t0}
                    r.result = api._result(trace, tracker)
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
        api._acquire(lm.lock, None)
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
    """The keywords of :func:`api._prepare` / :func:`api._run` for ``reqs`` decoded under
    ``settings`` (the entry point's defaults where a setting was not given; settings that
    are not in :data:`_SETTINGS` are the deprecated policy ``**options``)."""
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
        "system_prompt": settings.get("system_prompt", api._DEFAULT),
        "max_context_tokens": settings.get("max_context_tokens"),
        "options": {k: v for k, v in settings.items() if k not in _SETTINGS},
        "rendered": rendered if any(r is not None for r in rendered) else None,
    }


def _decode_batch(lm: LoadedModel, reqs: list[_Request], settings: dict[str, Any]) -> list[GenerationResult]:
    holder: list[GenerationResult] = []
    for _ in api._run(
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
    with _BATCHERS_LOCK:
        b = lm.__dict__.get("_micro_batcher")
        if b is None:
            b = lm.__dict__["_micro_batcher"] = MicroBatcher(lm)
        return b


def generate(
    lm: LoadedModel, query: str, passages: Any = None, *, batching: bool = True, **kwargs: Any
) -> GenerationResult:
    """:func:`api.generate`, micro-batched with concurrent calls on ``lm`` unless
    ``batching=False``."""
    if not require_bool(batching, "batching"):
        return api.generate(lm, query, passages, **kwargs)
    return batcher_for(lm).generate(query, passages, **kwargs)


def stream(
    lm: LoadedModel, query: str, passages: Any = None, *, batching: bool = True, **kwargs: Any
) -> TokenStream:
    """:func:`api.stream`, its query decoded in the continuous decode of concurrent calls on
    ``lm`` (:meth:`MicroBatcher.stream`) unless ``batching=False``."""
    if not require_bool(batching, "batching"):
        return api.stream(lm, query, passages, **kwargs)
    return batcher_for(lm).stream(query, passages, **kwargs)


async def astream_with_result(
    lm: LoadedModel, query: str, passages: Any = None, *, batching: bool = True, **kwargs: Any
) -> AsyncIterator[TokenEvent | GenerationResult]:
    """:func:`api.astream_with_result` over :func:`stream`: every event, then the result."""
    require_bool(batching, "batching")
    async for item in api._aiterate(functools.partial(stream, lm, query, passages, batching=batching, **kwargs)):
        yield item


async def agenerate(
    lm: LoadedModel, query: str, passages: Any = None, *, batching: bool = True, **kwargs: Any
) -> GenerationResult:
    """Async :func:`generate` (the decode runs in a worker thread). Cancelling a call that is
    decoded alone stops it at its next step, as :func:`api.agenerate` does; a cancelled call
    that shares a batch is dropped while the batch goes on for the others."""
    if not require_bool(batching, "batching"):
        return await api.agenerate(lm, query, passages, **kwargs)
    batcher = batcher_for(lm)
    return await api.run_cancellable(lambda cancel: batcher.generate(query, passages, _cancel=cancel, **kwargs))
