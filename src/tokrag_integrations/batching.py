"""Micro-batching of concurrent calls: calls that arrive together are decoded as one batch.

The framework adapters answer concurrent calls (LangChain ``batch``/``abatch``, LlamaIndex
``asyncio.gather`` over ``acomplete``) through :func:`generate`. The first call with a given
set of decoding settings waits ``wait_s`` for others with the same settings, then decodes
all of them with one batched decode (the path of :func:`api.generate_batch`: one forward
pass per context role per step); each caller gets its own result. Calls with different
settings (policy, its options, max_new_tokens, stop, system prompt, budget) never share a
batch. Streams never batch. The batched decode gives each query the tokens it gets alone
(tests/integration/test_batching.py checks it on the packaged model).

A batch that fails (a bad input raises before anything is decoded) is retried one call at a
time, so only the call with the bad input gets the error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import api
from .api import GenerationResult
from .booleans import require_bool
from .models import LoadedModel

#: Default wait for companions (seconds) and largest batch.
WAIT_S = 0.01
MAX_BATCH = 16

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


class MicroBatcher:
    """Collects concurrent :meth:`generate` calls on one model into batched decodes.

    ``batches`` counts the batched decodes run and ``batched_calls`` the calls they served
    (for tests and benchmarks; a call decoded alone counts in neither).
    """

    def __init__(self, lm: LoadedModel, wait_s: float = WAIT_S, max_batch: int = MAX_BATCH) -> None:
        self.lm, self.wait_s, self.max_batch = lm, float(wait_s), int(max_batch)
        self._lock = threading.Lock()
        self._pending: dict[str, list[_Request]] = {}
        self.batches = 0
        self.batched_calls = 0

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
        with self._lock:
            queue = self._pending.setdefault(key, [])
            queue.append(req)
            leader = len(queue) == 1
        if leader:
            # Wait while companions keep arriving: up to 10 waits, one quiet wait ends it.
            seen = 0
            for _ in range(10):
                time.sleep(self.wait_s)
                with self._lock:
                    n = len(self._pending[key])
                if n == seen or n >= self.max_batch:
                    break
                seen = n
            with self._lock:
                reqs = self._pending.pop(key)
            settings = {k: v for k, v in kwargs.items() if k not in _PER_CALL}
            try:
                for i in range(0, len(reqs), self.max_batch):
                    self._decode(reqs[i : i + self.max_batch], settings)
            finally:  # whatever happened, nobody waits forever
                for r in reqs:
                    if not r.done.is_set():
                        r.error = RuntimeError("the batch this call was part of was interrupted")
                        r.done.set()
        req.done.wait()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

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


def _decode_batch(lm: LoadedModel, reqs: list[_Request], settings: dict[str, Any]) -> list[GenerationResult]:
    options = dict(settings)
    core = {k: options.pop(k) for k in _SETTINGS if k in options}
    holder: list[GenerationResult] = []
    messages = [r.messages for r in reqs]
    rendered = [r.rendered for r in reqs]
    for _ in api._run(
        lm,
        [r.query for r in reqs],
        [r.passages for r in reqs],
        policy=core.get("policy", "tokrag"),
        policy_options=core.get("policy_options"),
        speed=core.get("speed"),
        prompt_format=core.get("prompt_format", "qa"),
        max_new_tokens=core.get("max_new_tokens", 64),
        stop=core.get("stop"),
        messages=messages if any(messages) else None,
        system_prompt=core.get("system_prompt", api._DEFAULT),
        max_context_tokens=core.get("max_context_tokens"),
        holder=holder,
        options=options,
        rendered=rendered if any(r is not None for r in rendered) else None,
    ):
        pass
    return holder


_BATCHERS_LOCK = threading.Lock()


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
