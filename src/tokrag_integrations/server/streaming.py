"""A streamed chat completion: ``chat.completion.chunk`` server-sent events, one per token of
each choice (with ``tokrag.source``, ``token_id`` and the token's ``text``, and its
``logprobs`` when asked), then each choice's last chunk with its ``finish_reason`` and full
``tokrag`` object, then the usage chunk when asked, then ``[DONE]``.

When the request may call tools, text that may start a call (``<tool_call>``, or all of it
under ``tool_choice`` ``required`` / a name) is held back from ``delta.content``; at the end
the answer is parsed and the calls sent as ``delta.tool_calls`` (OpenAI's streamed shape, one
entry per call with its ``index``), with ``finish_reason: "tool_calls"``. Every token still
has its chunk (``delta.content`` empty while held; ``tokrag.text`` always the token's text),
so a client that rebuilds the trace (the remote client) sees every token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

from ..adapters.translate import FINISH_REASONS, usage
from .refusals import RequestError
from .responses import (
    call_finish,
    logprob_entry,
    openai_tool_calls,
    tokrag_object,
    tool_calls_of,
    total_usage,
)
from .schemas import ChatRequest

__all__ = ["events", "sse"]

log = logging.getLogger("tokrag.serve")

_END = object()


def _finite(data: Any) -> Any:
    """``data`` with NaN and the infinities as None (JSON has no such numbers; the plain
    answer's encoder writes them as null too)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def sse(data: Any) -> bytes:
    """One server-sent event of ``data`` as strict JSON (never a bare ``NaN``)."""
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n".encode()


class _Held:
    """One choice's answer so far and how much of it ``delta.content`` has shown: text that
    may begin a tool call is held back until the answer ends."""

    def __init__(self, hold_all: bool, tools: bool) -> None:
        self.text = ""
        self.shown = 0
        self.hold_all = hold_all
        self.tools = tools
        if tools:  # where a call starts (the Hermes / Qwen format the structured package uses)
            from ..structured.tool_specs import CALL_OPEN

            self.start = CALL_OPEN

    def add(self, token_text: str) -> str:
        """The visible text this token adds (what can no longer be a call's start)."""
        self.text += token_text
        if not self.tools:
            safe = len(self.text)
        elif self.hold_all:
            safe = 0
        else:
            at = self.text.find(self.start, self.shown)
            if at >= 0:
                safe = at
            else:  # a tail that may grow into the marker stays held
                safe = len(self.text)
                for k in range(min(len(self.start) - 1, len(self.text)), 0, -1):
                    if self.start.startswith(self.text[-k:]):
                        safe = len(self.text) - k
                        break
        safe = max(safe, self.shown)
        new, self.shown = self.text[self.shown:safe], safe
        return new


async def events(
    svc: Any, req: ChatRequest, streams: list[Any], fan: list[list[int]], head: dict[str, Any],
    notes: list[str], telemetry: Any, started: float,
) -> AsyncIterator[bytes]:
    """Server-sent events for the token streams of one request: ``streams[j]`` answers the
    choices ``fan[j]`` (one stream for every choice of a greedy ``n``). Each decode is read by
    a thread of its own as fast as the model goes and queued here, so the model is released
    when the answer is done, however slowly the client reads; closing this generator (the
    client left) stops them. ``telemetry`` gets the first token and the answer (the request
    arrived at ``started``)."""
    from ..results import TokenEvent

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        with suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def pump(j: int, token_stream: Any) -> None:
        try:
            for ev in token_stream:
                put((j, ev))
            put((j, token_stream.result))
        except BaseException as exc:  # noqa: BLE001 - handed to the response
            put((j, exc))
        finally:
            put((j, _END))

    def chunk(index: int | None, delta: dict[str, Any] | None, finish: str | None = None,
              logprobs: Any = None, **extra: Any) -> bytes:
        """One ``chat.completion.chunk`` event (``index`` None: no choice, the usage chunk)."""
        choices = [] if index is None else [
            {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
        extra = {k: v for k, v in extra.items() if v is not None}
        return sse({**head, "object": "chat.completion.chunk", "choices": choices, **extra})

    hold_all = req.tool_choice != "auto"
    held = {i: _Held(hold_all, req.calls_tools) for f in fan for i in f}
    threads = [threading.Thread(target=pump, args=(j, s), name=f"tokrag-sse-{j}", daemon=True)
               for j, s in enumerate(streams)]
    results: list[Any] = [None] * len(streams)
    open_streams = len(streams)
    first = failed = False
    try:
        for i in held:
            yield chunk(i, {"role": "assistant", "content": ""})
        for t in threads:
            t.start()
        while open_streams:
            j, item = await queue.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, TokenEvent):  # one chunk per token, some with empty text
                if not first:
                    first = True
                    telemetry.first_token(started)
                lp = {"content": [logprob_entry(item.step)]} if req.logprobs else None
                extra = {"source": item.source, "token_id": item.token_id, "text": item.text}
                for i in fan[j]:
                    yield chunk(i, {"content": held[i].add(item.text)}, logprobs=lp, tokrag=extra)
            elif isinstance(item, BaseException):
                failed = True
                if isinstance(item, (TypeError, ValueError)):
                    body = RequestError(str(item)).to_dict()
                else:
                    log.error("stream failed", exc_info=item)
                    body = RequestError(f"internal error ({type(item).__name__}); see the "
                                        "server log", None, 500, "server_error").to_dict()
                yield sse(body)
                break
            else:  # the GenerationResult of stream j
                results[j] = item
                for i in fan[j]:
                    for delta, finish, tokrag in _ending(item, req, held[i], notes):
                        yield chunk(i, delta, finish, tokrag=tokrag)
        if not failed and all(r is not None for r in results):
            answers = [results[j] for j, f in enumerate(fan) for _ in f]
            telemetry.answered(results, usage(results[0])["prompt_tokens"], started)
            if req.include_usage:
                yield chunk(None, None, usage=total_usage(answers))
            yield b"data: [DONE]\n\n"
    finally:
        # No await here: when the client leaves, this runs inside a cancelled scope, where
        # every await raises again. Closing stops each decode at its next step (its thread
        # then releases the model and the pump thread ends).
        for s in streams:
            s.close()
        if any(r is None for r in results):
            svc.streams_cut += 1
        svc.active -= 1


def _ending(result: Any, req: ChatRequest, held: _Held, notes: list[str]
            ) -> list[tuple[dict[str, Any], str | None, dict[str, Any] | None]]:
    """The last chunks of a choice, ``(delta, finish_reason, tokrag)`` each: the held text or
    the tool calls, then the finish with the ``tokrag`` object."""
    content, calls = tool_calls_of(result.text, req)
    parts: list[tuple[dict[str, Any], str | None, dict[str, Any] | None]] = []
    finish = FINISH_REASONS.get(result.stop_reason, "stop")
    shown = held.text[:held.shown]
    if calls:
        rest = content[len(shown):] if content.startswith(shown) else ""
        if rest:
            parts.append(({"content": rest}, None, None))
        parts.append(({"tool_calls": openai_tool_calls(calls, streamed=True)}, None, None))
        finish = call_finish(result)
    else:
        rest = held.text[held.shown:]
        if rest:
            parts.append(({"content": rest}, None, None))
    parts.append(({}, finish, tokrag_object(result, req, notes)))
    return parts
