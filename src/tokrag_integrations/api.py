"""Public entry points: generate, stream, generate_batch and their async forms."""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import numbers
import queue
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import config
from .defaults import MAX_NEW_TOKENS
from .models import LoadedModel
from .policies import get_policy
from .policies.base import Policy
from .prompts import PromptBuilder, PromptPlan, RenderedPrompt, clean_text
from .runner import decode_loop
from .trace import Trace, TraceStep


@dataclass
class GenerationResult:
    """The answer, its token ids and the trace explaining it."""

    text: str
    trace: Trace
    token_ids: list[int] = field(default_factory=list)

    @property
    def stop_reason(self) -> str:
        return self.trace.stop_reason

    @property
    def counts(self) -> dict[str, int]:
        return self.trace.counts()


@dataclass
class TokenEvent:
    """One chosen token, yielded by :func:`stream` as soon as it is chosen.

    ``text`` is the new answer text this token adds (may be empty while a possible stop
    string is held back, or for a partial multi-byte character); ``source`` its provenance.
    """

    query_idx: int
    index: int
    token_id: int
    text: str
    source: str
    step: TraceStep


def _speed_paths_off(lm: LoadedModel) -> dict[str, Any]:
    """``{"speed_paths_off": {path: reason}}`` for the trace options where some speed path is
    off on this model (non-CPU device, non-float32 dtype, architecture outside the tested
    matrix, ``cpu_kernels='off'``), else nothing."""
    from .accel import speed_paths

    # "on" may carry what was measured ("on (...)"): only the paths that are off count.
    off = {k: v.removeprefix("off: ") for k, v in speed_paths(lm.model).items() if v.startswith("off")}
    return {"speed_paths_off": off} if off else {}

def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    return [s for s in stop if s]


class _TextTracker:
    """Incremental detokenisation with stop-string hold-back, so streamed deltas always add up
    to the final text."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0
        self.final: str | None = None

    def text(self) -> str:
        t = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = t.find(s)
            if i >= 0:
                t = t[:i]
        return t

    def push(self, token_id: int | None, finished: bool) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        t = self.text()
        if finished:
            self.final = t
            safe = len(t)
        else:
            safe = len(t)
            if t.endswith("\ufffd"):
                safe = len(t.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, len(t)), 0, -1):
                    if t.endswith(s[:k]):
                        safe = min(safe, len(t) - k)
                        break
        delta = t[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta


#: Seconds a started stream may sit unread before it is abandoned (see :class:`TokenStream`).
DEFAULT_IDLE_TIMEOUT = config.DEFAULT_STREAM_IDLE_TIMEOUT_S
IDLE_TIMEOUT_ENV = config.STREAM_IDLE_TIMEOUT


class StreamAbandoned(RuntimeError):
    """A stream was left unread longer than its idle timeout and closed to free the model."""


class _Cancelled(Exception):
    """Internal: the caller cancelled a decode (a closed stream, a cancelled ``agenerate``)."""


def idle_timeout_from(value: float | None) -> float:
    """The idle timeout to use: ``value`` if given, else ``$TOKRAG_STREAM_IDLE_TIMEOUT``, else
    :data:`DEFAULT_IDLE_TIMEOUT` (seconds, > 0)."""
    source = "idle_timeout"
    if value is None:
        return config.stream_idle_timeout()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{source} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _acquire(lock: Any, stop: threading.Event | None) -> None:
    """Take the model lock, giving up (``_Cancelled``) as soon as ``stop`` is set."""
    if stop is None:
        lock.acquire()
        return
    while not lock.acquire(timeout=0.05):
        if stop.is_set():
            raise _Cancelled


_END = object()
_ABANDONED = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


#: Stream workers whose decode thread may still be running (see :func:`_stop_streams_at_exit`).
_LIVE_WORKERS: weakref.WeakSet[_StreamWorker] = weakref.WeakSet()


@atexit.register
def _stop_streams_at_exit() -> None:
    """Stop every stream's decode thread and wait for it before the interpreter shuts down.

    A decode thread is a daemon thread (an unread stream must not keep the process alive), but
    a daemon thread still inside a torch kernel when the interpreter finalizes is killed in
    C++ code: "terminate called without an active exception", exit status 134. A closed or
    abandoned stream's thread finishes its current step first, so it is stopped here and
    joined; each step is short, so this waits at most one decoding step per stream.
    """
    for worker in list(_LIVE_WORKERS):
        worker.close()
    for worker in list(_LIVE_WORKERS):
        worker.join()


class _StreamWorker:
    """Runs one stream's decode in its own thread, one event ahead of the reader.

    The model lock, ``torch.inference_mode`` and the generator's frames all live in this one
    thread, so any thread may read the stream. The worker computes an event only when the
    reader has asked for the previous one; if no request comes within ``idle_timeout`` it
    abandons the stream, closing the decode (which releases the model lock).
    """

    def __init__(self, gen: Iterator[Any], stop: threading.Event, idle_timeout: float):
        self._gen = gen
        self._stop = stop
        self._idle_timeout = idle_timeout
        self._credits = threading.Semaphore(0)
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ctx = contextvars.copy_context()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._unstarted_closed = False
        self.abandoned = False

    def request(self) -> Any:
        """The next item: an event, ``_END``, ``_ABANDONED`` or a ``_Failure``."""
        with self._start_lock:
            if self._unstarted_closed:
                return _END
            if self._thread is None:
                self._credits.release()  # one event of look-ahead
                self._thread = threading.Thread(
                    target=self._ctx.run, args=(self._work,), name="tokrag-stream", daemon=True
                )
                _LIVE_WORKERS.add(self)
                self._thread.start()
        self._credits.release()
        return self._out.get()

    def _work(self) -> None:
        final: Any = _END
        try:
            while True:
                if not self._credits.acquire(timeout=self._idle_timeout):
                    self.abandoned = True
                    final = _ABANDONED
                    return
                if self._stop.is_set():
                    return
                try:
                    item = next(self._gen)
                except StopIteration:
                    return
                except _Cancelled:
                    return
                except BaseException as e:  # handed to the reader
                    final = _Failure(e)
                    return
                self._out.put(item)
        finally:
            self._stop.set()
            try:
                self._gen.close()  # releases the model lock, in the thread that took it
            finally:
                self._out.put(final)

    def close(self) -> None:
        """Stop the decode at its next step (or at once, when it never started)."""
        self._stop.set()
        with self._start_lock:
            if self._thread is None:
                self._unstarted_closed = True
                self._gen.close()  # never started: no lock held, nothing runs
                return
        self._credits.release()  # wakes a worker waiting for a request

    def join(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class TokenStream:
    """Iterator of :class:`TokenEvent`; after it is exhausted ``results`` (and ``result`` for
    a single query) hold the full :class:`GenerationResult` objects.

    The decode runs in a thread of its own, started by the first ``next()`` (an unread stream
    never takes the model), one token ahead of the reader; the model's lock is held from the
    first ``next()`` until the stream ends. Any thread may advance the stream, several threads
    may share it (each event goes to exactly one of them). The lock is released when the stream
    is exhausted, fails, is closed (:meth:`close`, ``with stream(...) as s:``), is garbage
    collected, or is **abandoned**: a started stream that nobody reads for ``idle_timeout``
    seconds (argument of :func:`stream`, else ``$TOKRAG_STREAM_IDLE_TIMEOUT``, default 30) is
    closed and its next ``next()`` raises :class:`StreamAbandoned`.

    Because the decode has its own thread, a thread that holds ``lm.lock`` itself cannot read
    a stream (``RuntimeError``), and a thread that calls :func:`generate` on the same model
    while its own stream is unfinished waits until that stream ends or is abandoned.
    """

    def __init__(
        self,
        gen: Iterator[TokenEvent],
        holder: list[GenerationResult],
        *,
        stop: threading.Event | None = None,
        idle_timeout: float | None = None,
        model_lock: Any = None,
    ):
        self._holder = holder
        self._model_lock = model_lock
        self._worker = _StreamWorker(gen, stop or threading.Event(), idle_timeout_from(idle_timeout))
        self._read_lock = threading.Lock()
        self._state = "open"  # open | done | closed | abandoned
        self._finalizer = weakref.finalize(self, self._worker.close)

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenEvent:
        with self._read_lock:
            if self._worker.abandoned:  # a look-ahead event may be queued: it is not given out
                self._state = "abandoned"
            if self._state == "abandoned":
                raise StreamAbandoned(self._abandoned_message())
            if self._state != "open":
                raise StopIteration
            owned = getattr(self._model_lock, "_is_owned", None)
            if owned is not None and owned():
                raise RuntimeError(
                    "this thread holds lm.lock, which the stream's decode thread needs; release "
                    "it before reading the stream (or use generate(), which may run under it)"
                )
            item = self._worker.request()
            if isinstance(item, TokenEvent):
                return item
            if item is _ABANDONED:
                self._state = "abandoned"
                raise StreamAbandoned(self._abandoned_message())
            self._state = "done" if item is _END and self._holder else "closed"
            if isinstance(item, _Failure):
                raise item.error
            raise StopIteration

    def _next_or_end(self) -> Any:
        """``next(self)`` with ``_END`` for the end (StopIteration cannot cross a Future)."""
        try:
            return next(self)
        except StopIteration:
            return _END

    def _abandoned_message(self) -> str:
        return (
            f"the stream was not read for {self._worker._idle_timeout:g} s and was closed to "
            f"free the model; read it sooner or raise idle_timeout (or ${IDLE_TIMEOUT_ENV})"
        )

    def close(self) -> None:
        """Stop decoding at the next step and release the model; later ``next()`` calls end
        the iteration. Safe to call from any thread, more than once."""
        # A reader blocked in next() holds the read lock; it then gets the end from the worker.
        if self._read_lock.acquire(blocking=False):
            try:
                if self._state == "open":
                    self._state = "closed"
            finally:
                self._read_lock.release()
        self._worker.close()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        self._worker.join()

    @property
    def results(self) -> list[GenerationResult]:
        if self._state == "closed" and not self._holder:
            raise RuntimeError("the stream was closed before its end, so it has no result")
        if not self._holder:
            raise RuntimeError("the stream has not been consumed yet")
        return self._holder

    @property
    def result(self) -> GenerationResult:
        return self.results[0]


def _plans(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None],
    *,
    max_new_tokens: int,
    messages: Sequence[list[dict[str, str]] | None] | None,
    system_prompt: str | None | type,
    max_context_tokens: int | None,
    prompt_format: str = "qa",
    rendered: Sequence[RenderedPrompt | None] | None = None,
) -> list[PromptPlan]:
    kw: dict[str, Any] = {"context_window": lm.context_window}
    if system_prompt is not _DEFAULT:
        kw["system_prompt"] = system_prompt
    elif prompt_format != "qa":
        kw["system_prompt"] = None  # a raw prompt gets no injected wording
    builder = PromptBuilder(lm.tokenizer, **kw)
    return [
        builder.build_rendered(
            q,
            rendered[i],
            max_new_tokens=max_new_tokens,
            messages=(messages[i] if messages else None),
            max_context_tokens=max_context_tokens,
        )
        if rendered and rendered[i] is not None
        else builder.build(
            q,
            p,
            max_new_tokens=max_new_tokens,
            messages=(messages[i] if messages else None),
            max_context_tokens=max_context_tokens,
            prompt_format=prompt_format,
        )
        for i, (q, p) in enumerate(zip(queries, passages, strict=True))
    ]


class _Default:
    pass


_DEFAULT = _Default


def _where(what: str, i: int | None) -> str:
    return what if i is None else f"{what} {i}"


def _check_query(q: Any, i: int | None) -> str:
    if not isinstance(q, str):
        raise TypeError(f"{_where('query', i)} must be a string, got {type(q).__name__}")
    return clean_text(q, _where("query", i))


def _check_passages(p: Any, i: int | None) -> None:
    if p is None:
        return
    what = "passages" if i is None else f"the passages of query {i}"
    if isinstance(p, (str, bytes)):
        raise TypeError(f"{what} must be a list of passages, not a single {type(p).__name__}; wrap it in a list")
    if not isinstance(p, Sequence):
        raise TypeError(f"{what} must be a list of passages (str, Passage or (text, score)), got {type(p).__name__}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _run(
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
    holder: list[GenerationResult],
    options: dict[str, Any],
    cancel: threading.Event | None = None,
    rendered: Sequence[RenderedPrompt | None] | None = None,
) -> Iterator[TokenEvent]:
    """Validate everything, build the prompts, and return the (not yet started) decode.

    The decode takes ``lm.lock`` on its first step and releases it when it ends or is closed;
    with ``cancel`` it stops (``_Cancelled``) at the first step after ``cancel`` is set.
    """
    if not isinstance(lm, LoadedModel):
        raise TypeError("the first argument must be a LoadedModel from tokrag_integrations.load_model()")
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings")
    if len(queries) != len(passages):
        raise ValueError(f"got {len(queries)} queries but {len(passages)} passage lists")
    queries = [_check_query(q, i if len(queries) > 1 else None) for i, q in enumerate(queries)]
    for i, p in enumerate(passages):
        _check_passages(p, i if len(passages) > 1 else None)
    if rendered is not None:
        if len(rendered) != len(queries):
            raise ValueError(f"got {len(queries)} queries but {len(rendered)} rendered prompts")
        for i, r in enumerate(rendered):
            if r is not None and not isinstance(r, RenderedPrompt):
                raise TypeError(f"{_where('rendered', i)} must be a RenderedPrompt, got {type(r).__name__}")
            if r is not None and passages[i]:
                raise ValueError("give passages or a rendered prompt (its context), not both")
    _check_count("max_new_tokens", max_new_tokens)
    if max_context_tokens is not None:
        _check_count("max_context_tokens", max_context_tokens)
    if not queries:
        return iter(())
    # Raw-prompt path of the adapters (see PromptBuilder.build); not a policy option.
    prompt_format = options.pop("prompt_format", "qa")
    pol = get_policy(policy, **options)
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
                warnings.warn(msg, stacklevel=4)
        groups.setdefault("llm" if fallback else "main", []).append(i)

    traces = [
        Trace(
            query=queries[i],
            policy=pol.name,
            model=lm.name,
            options={**pol.options(), **_speed_paths_off(lm)},
            passages=plans[i].passages,
            warnings=list(plans[i].warnings),
            prompt_tokens={"pure": len(plans[i].pure_ids), "rag": len(plans[i].rag_ids) if plans[i].has_passages else 0},
        )
        for i in range(len(queries))
    ]
    trackers = [_TextTracker(lm.tokenizer, stops) for _ in queries]

    def events() -> Iterator[TokenEvent]:
        # The model lock is taken on the first next(), not when the stream is created, so
        # an unread stream never blocks other users of the model.
        _acquire(lm.lock, cancel)
        try:
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            for group, idx in groups.items():
                use = llm_pol if group == "llm" else pol
                timings: dict[str, float] = {}
                t0 = time.perf_counter()
                for ev in decode_loop(
                    lm,
                    [plans[i] for i in idx],
                    use,
                    max_new_tokens=max_new_tokens,
                    stop=stops,
                    timings=timings,
                ):
                    q = idx[ev.query_idx]
                    tr = traces[q]
                    is_eos = ev.stop_reason == "eos"
                    if not is_eos:
                        tr.steps.append(ev.step)
                    delta = trackers[q].push(None if is_eos else ev.step.token_id, ev.finished)
                    if ev.finished:
                        tr.stop_reason = ev.stop_reason
                    if not is_eos or delta:
                        yield TokenEvent(q, ev.step.index, ev.step.token_id, delta, ev.step.source, ev.step)
                    if cancel is not None and cancel.is_set():
                        raise _Cancelled
                total = time.perf_counter() - t0
                for i in idx:
                    traces[i].timings = {**timings, "total_s": total, "queries_in_batch": float(len(idx))}
        finally:
            lm.lock.release()
        for q, tr in enumerate(traces):
            tr.text = trackers[q].final if trackers[q].final is not None else trackers[q].text()
            holder.append(GenerationResult(text=tr.text, trace=tr, token_ids=list(trackers[q].ids)))

    return events()


def generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
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
        max_new_tokens / stop: stopping rules (EOS always stops).
        messages: earlier chat turns (role/content dicts) placed before the question.
        system_prompt: override the builder's default system prompt (None = no system turn).
        max_context_tokens: a tighter context budget than the model's window.
        **options: the policy's options (e.g. ``pr_norm="softmax"``, ``variant="reference"``);
            ``prompt_format="chat"|"text"`` (without passages: the query as the raw user turn
            or the exact prompt, no default system prompt; see ``PromptBuilder.build``);
            ``rendered=RenderedPrompt(...)`` instead of ``passages``: the RAG context is the
            caller's own formatted prompt and its retrieved tokens are where its context
            variable landed (the framework adapters' path; see ``PromptBuilder.build_rendered``).

    Raises:
        TypeError / ValueError: a bad argument (checked before anything is decoded).
    """
    return _generate(
        lm,
        query,
        passages,
        policy=policy,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=messages,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        **options,
    )


def _generate(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    cancel: threading.Event | None = None,
    **options: Any,
) -> GenerationResult:
    holder: list[GenerationResult] = []
    rendered = options.pop("rendered", None)
    events = _run(
        lm,
        [query],
        [passages],
        policy=policy,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=[messages] if messages else None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
        cancel=cancel,
        rendered=None if rendered is None else [rendered],
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
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    idle_timeout: float | None = None,
    **options: Any,
) -> TokenStream:
    """Like :func:`generate` but yields a :class:`TokenEvent` per chosen token as it is chosen.

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
    rendered = options.pop("rendered", None)
    gen = _run(
        lm,
        [query],
        [passages],
        policy=policy,
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=[messages] if messages else None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
        cancel=stop_event,
        rendered=None if rendered is None else [rendered],
    )
    return TokenStream(gen, holder, stop=stop_event, idle_timeout=timeout, model_lock=lm.lock)


def generate_batch(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None] | None = None,
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: str | Sequence[str] | None = None,
    max_context_tokens: int | None = None,
    system_prompt: Any = _DEFAULT,
    **options: Any,
) -> list[GenerationResult]:
    """Decode several queries as one batch (one forward pass per context role per step).

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
        max_new_tokens=max_new_tokens,
        stop=stop,
        messages=None,
        system_prompt=system_prompt,
        max_context_tokens=max_context_tokens,
        holder=holder,
        options=options,
    ):
        pass
    return holder


async def agenerate(lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any) -> GenerationResult:
    """Async :func:`generate`: the model runs in a worker thread, never on the event loop.

    Cancelling the task stops the decode at its next step (or while it waits for the model);
    the cancellation is re-raised once the worker has let go of the model.
    """
    return await run_cancellable(lambda cancel: _generate(lm, query, passages, cancel=cancel, **kwargs))


async def run_cancellable(call: Callable[[threading.Event], Any]) -> Any:
    """Await ``call(cancel)`` run in a worker thread (with the caller's context variables).

    Cancelling the awaiting task sets ``cancel`` (the decode stops at its next step), waits
    until the worker has let go of the model, then re-raises the cancellation."""
    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    fut = loop.run_in_executor(None, contextvars.copy_context().run, functools.partial(call, cancel))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the worker's _Cancelled is expected
        raise


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
    loop = asyncio.get_running_loop()
    s = await asyncio.to_thread(stream, lm, query, passages, **kwargs)
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
