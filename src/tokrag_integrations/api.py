"""Public entry points: generate, stream, generate_batch and their async forms."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .decoding import Policy, decode_loop
from .models import LoadedModel
from .policies import get_policy
from .prompts import PromptBuilder, PromptPlan
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


def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
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


class TokenStream:
    """Iterator of :class:`TokenEvent`; after it is exhausted ``results`` (and ``result`` for
    a single query) hold the full :class:`GenerationResult` objects."""

    def __init__(self, gen: Iterator[TokenEvent], holder: list[GenerationResult]):
        self._gen = gen
        self._holder = holder

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._gen)

    @property
    def results(self) -> list[GenerationResult]:
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
) -> list[PromptPlan]:
    kw: dict[str, Any] = {"context_window": lm.context_window}
    if system_prompt is not _DEFAULT:
        kw["system_prompt"] = system_prompt
    builder = PromptBuilder(lm.tokenizer, **kw)
    return [
        builder.build(
            q,
            p,
            max_new_tokens=max_new_tokens,
            messages=(messages[i] if messages else None),
            max_context_tokens=max_context_tokens,
        )
        for i, (q, p) in enumerate(zip(queries, passages, strict=True))
    ]


class _Default:
    pass


_DEFAULT = _Default


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
) -> Iterator[TokenEvent]:
    if not isinstance(lm, LoadedModel):
        raise TypeError("the first argument must be a LoadedModel from tokrag_integrations.load_model()")
    if isinstance(queries, str):
        raise TypeError("queries must be a list of strings")
    if len(queries) != len(passages):
        raise ValueError(f"got {len(queries)} queries but {len(passages)} passage lists")
    if not queries:
        return iter(())
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
            options=pol.options(),
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
        with lm.lock:
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
                total = time.perf_counter() - t0
                for i in idx:
                    traces[i].timings = {**timings, "total_s": total, "queries_in_batch": float(len(idx))}
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
    max_new_tokens: int = 64,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    **options: Any,
) -> GenerationResult:
    """Answer ``query`` with ``passages`` (ranked, best first) under a decoding ``policy``.

    Args:
        lm: from :func:`tokrag_integrations.load_model`.
        query: the question (the content of the final user turn).
        passages: strings, :class:`Passage` objects or (text, score) pairs; empty or None
            answers from the pure context and records that in the trace.
        policy: ``"tokrag"`` (default), ``"rag"``, ``"llm"``... or a Policy instance.
        max_new_tokens / stop: stopping rules (EOS always stops).
        messages: earlier chat turns (role/content dicts) placed before the question.
        system_prompt: override the builder's default system prompt (None = no system turn).
        max_context_tokens: a tighter context budget than the model's window.
        **options: the policy's options (e.g. ``pr_norm="softmax"``, ``variant="reference"``).
    """
    s = stream(
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
    for _ in s:
        pass
    return s.result


def stream(
    lm: LoadedModel,
    query: str,
    passages: Sequence[Any] | None = None,
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = 64,
    stop: str | Sequence[str] | None = None,
    messages: list[dict[str, str]] | None = None,
    system_prompt: Any = _DEFAULT,
    max_context_tokens: int | None = None,
    **options: Any,
) -> TokenStream:
    """Like :func:`generate` but yields a :class:`TokenEvent` per chosen token as it is chosen.

    Validation (empty query, unknown policy, prompt too long) happens here, before the first
    token, so errors surface at the call site.
    """
    holder: list[GenerationResult] = []
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
    )
    return TokenStream(gen, holder)


def generate_batch(
    lm: LoadedModel,
    queries: Sequence[str],
    passages: Sequence[Sequence[Any] | None] | None = None,
    *,
    policy: str | Policy = "tokrag",
    max_new_tokens: int = 64,
    stop: str | Sequence[str] | None = None,
    max_context_tokens: int | None = None,
    system_prompt: Any = _DEFAULT,
    **options: Any,
) -> list[GenerationResult]:
    """Decode several queries as one batch (one forward pass per context role per step)."""
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
    """Async :func:`generate`: the model runs in a worker thread, never on the event loop."""
    return await asyncio.to_thread(generate, lm, query, passages, **kwargs)


async def astream(
    lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any
) -> AsyncIterator[TokenEvent]:
    """Async :func:`stream`: tokens are produced in a worker thread and handed to the loop.

    Yields only :class:`TokenEvent` objects; use :func:`astream_with_result` to also receive
    the final :class:`GenerationResult`.
    """
    async for ev in astream_with_result(lm, query, passages, **kwargs):
        if isinstance(ev, TokenEvent):
            yield ev


async def astream_with_result(
    lm: LoadedModel, query: str, passages: Sequence[Any] | None = None, **kwargs: Any
) -> AsyncIterator[TokenEvent | GenerationResult]:
    """Yields every :class:`TokenEvent` and finally the :class:`GenerationResult`."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    _END = object()
    cancelled = threading.Event()

    def worker() -> None:
        try:
            s = stream(lm, query, passages, **kwargs)
            for ev in s:
                if cancelled.is_set():
                    return
                loop.call_soon_threadsafe(queue.put_nowait, ev)
            loop.call_soon_threadsafe(queue.put_nowait, s.result)
        except BaseException as e:  # surfaced to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, e)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, _END)

    fut = loop.run_in_executor(None, worker)
    try:
        while True:
            item = await queue.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()
        await fut
