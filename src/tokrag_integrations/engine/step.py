"""The step: the one step loop of the scheduler (:class:`_Loop`). Queued calls are admitted at
step boundaries while they fit the batcher's bounds (context rows, positions, prefill tokens),
every group's decoder chooses and advances one step, and a call whose queries are all
finished gets its results; :func:`_alone` is the loop of a call decoded alone, in the calling
thread. The calls are prepared in :mod:`.admission`; the entry points are :mod:`.scheduler`."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..models import LoadedModel
from ..results import GenerationResult, TokenEvent
from .admission import _Prepared, _Query, _Request, _request
from .decoder import Decoder, StepEvent
from .loop import SequenceDecoder, decoder_for
from .seam import speed_paths_off
from .streams import (
    _acquire,
    _Cancelled,
)


class _Loop:
    """The one step loop of the scheduler: queued calls are admitted at step boundaries,
    every group's decoder (``main``; ``no_rag`` for queries without usable passages) chooses and
    advances one step, and a call whose queries are all finished gets its results.

    With a ``batcher``, calls are admitted while they fit its bounds (``max_rows`` /
    ``max_positions`` / ``max_prefill_tokens``; with ``continuous=False`` only into an empty
    decode, ``max_batch`` at a time). Without one, the loop of a call decoded alone.
    """

    def __init__(
        self, lm: LoadedModel, max_new_tokens: int, batcher: Any = None
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
            ids = d.admit([p.plans[i] for i in idx], sampling=[p.sampling[i] for i in idx])
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
