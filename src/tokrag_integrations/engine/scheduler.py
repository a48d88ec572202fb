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

Split by what it does: a call checked and prepared for a decode (:mod:`.admission`), the step
loop that admits prepared calls at step boundaries and steps every decoder (:mod:`.step`), and
here the public entry points with the batcher that gathers concurrent calls into decodes.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

from ..config import require_bool
from ..defaults import CITATIONS, MAX_NEW_TOKENS
from ..inputs import _DEFAULT
from ..models import LoadedModel
from ..policies.base import Policy
from ..prompts import RenderedPrompt
from ..results import GenerationResult, TokenEvent
from ..sampling import TokenConstraint
from ..speed import Speed
from .admission import _PER_CALL, _prepare, _Request, _request
from .step import _alone, _generate, _Loop
from .streams import (
    _END,
    DECODE_THREADS,
    TokenStream,
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
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    top_logprobs: int = 0,
    constraint: TokenConstraint | Mapping[str, Any] | None = None,
) -> GenerationResult:
    """Answer ``query`` with ``passages`` (ranked, best first) under a decoding ``policy``.

    Args:
        lm: from :func:`tokrag_integrations.load_model`.
        query: the question (the content of the final user turn).
        passages: a list of strings, :class:`Passage` objects or (text, score) pairs; empty
            or None answers from the pure context and records that in the trace.
        policy: ``"tokrag"`` (default), ``"rag"``, ``"no_rag"``... or a Policy instance.
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
            context's layers anyway (``tokrag``, ``tokrag_authors``), True for every policy
            with a ``rag`` context (it is then probed: ``rag``, ``cad``...), False never.
            Steps without a ``rag`` context (``no_rag``, ``rag_token``, ``rag_sequence``) carry
            none.
        temperature / top_p / top_k / seed: how the token is taken from the distribution the
            rule chose at each step (docs/algorithm.md, "Sampling"): ``temperature`` 0 or None
            (default) is greedy, exactly the rule's tokens; above 0 the token is drawn from
            softmax(z / T) cut to the ``top_k`` most likely tokens (0: no cut) and the
            ``top_p`` nucleus (1: no cut), with noise from ``seed`` (None: one drawn and
            recorded in ``trace.sampling``): one seed gives the same tokens alone, in any
            batch and on any speed path. Per call: calls with other values share a decode.
        top_logprobs: 0..20 most likely tokens recorded at every step with their
            log-probabilities (``trace.steps[i].top_logprobs``, ``result.logprobs``); every
            step records its token's log-probability anyway.
        constraint: structured output: a :class:`.sampling.TokenConstraint`, or a spec
            (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {...}}``,
            ``{"type": "regex", "regex": ...}``, ``{"type": "grammar", "grammar": ...}``;
            needs ``pip install 'tokrag-integrations[structured]'``): the tokens it forbids
            are masked in every context of the query before the rule runs, and the answer
            ends (``stop_reason="stop"``) when the grammar is complete.

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
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        top_logprobs=top_logprobs,
        constraint=constraint,
    )
    if not require_bool(batching, "batching"):
        return _generate(lm, query, passages, **kwargs)
    return batcher_for(lm).generate(query, passages, **kwargs)


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
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | Sequence[int | None] | None = None,
    top_logprobs: int = 0,
    constraint: Any = None,
) -> list[GenerationResult]:
    """Decode several queries as one batch (one forward pass per context role per step),
    in the calling thread; the arguments are those of :func:`generate`.

    ``queries`` is a list of strings and ``passages`` (if given) one list of passages per
    query; a single string for either is refused. ``seed`` and ``constraint`` may be a list
    (one per query); one seed serves every query (each gets the tokens it gets alone with
    it), one constraint object is forked for each.
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
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        top_logprobs=top_logprobs,
        constraint=constraint,
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
