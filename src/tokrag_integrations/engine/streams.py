"""The thread machinery of a stream: :class:`TokenStream` runs a decode in a thread of its
own, one token ahead of its reader, and lets go of the model when the stream ends, is
closed, is garbage collected or is abandoned (left unread past its idle timeout)."""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import numbers
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .. import config
from ..results import GenerationResult, TokenEvent

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "IDLE_TIMEOUT_ENV",
    "StreamAbandoned",
    "TokenStream",
    "idle_timeout_from",
    "run_cancellable",
]


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


#: Stream workers whose decode thread may still be running, and the scheduler's decode
#: threads (a call returns as soon as its own answer is done, while its decode thread still
#: finishes that step): see :func:`_stop_streams_at_exit`.
_LIVE_WORKERS: weakref.WeakSet[_StreamWorker] = weakref.WeakSet()
DECODE_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _stop_streams_at_exit() -> None:
    """Stop every stream's decode thread and wait for it, and for the scheduler's decode
    threads, before the interpreter shuts down.

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
    for thread in list(DECODE_THREADS):
        thread.join(timeout=60)


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
        self._worker = _StreamWorker(
            gen, stop or threading.Event(), idle_timeout_from(idle_timeout)
        )
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


async def run_cancellable(call: Callable[[threading.Event], Any]) -> Any:
    """Await ``call(cancel)`` run in a worker thread (with the caller's context variables).

    Cancelling the awaiting task sets ``cancel`` (the decode stops at its next step), waits
    until the worker has let go of the model, then re-raises the cancellation."""
    loop = asyncio.get_running_loop()
    cancel = threading.Event()
    fut = loop.run_in_executor(
        None, contextvars.copy_context().run, functools.partial(call, cancel)
    )
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        cancel.set()
        await asyncio.wait([fut])
        if not fut.cancelled():
            fut.exception()  # retrieved: the worker's _Cancelled is expected
        raise
