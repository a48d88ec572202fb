"""The core's results as LlamaIndex responses: streamed tokens, chat responses and
log-probabilities (``List[List[LogProb]]``: per generated token, the token itself, then its
``top_logprobs`` alternatives, best first)."""

from __future__ import annotations

import math
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    LogProb,
    MessageRole,
)

from ..results import GenerationResult, TokenEvent


def _logprob(entry: dict[str, Any]) -> LogProb:
    """One entry as a ``LogProb``; NaN where the rule gave no log-probability (a custom
    policy without ``Choice.logits``)."""
    lp = entry["logprob"]
    return LogProb(
        token=entry["token"], logprob=math.nan if lp is None else lp, bytes=list(entry["bytes"])
    )


def result_logprobs(result: GenerationResult) -> list[list[LogProb]]:
    """Per generated token of ``result`` (:attr:`GenerationResult.logprobs`, OpenAI's
    content-logprob shape), ``[token, *top_logprobs]``."""
    return [[_logprob(e), *map(_logprob, e.get("top_logprobs") or [])] for e in result.logprobs]


def step_logprobs(ev: TokenEvent) -> list[LogProb]:
    """``[token, *top_logprobs]`` of one streamed token (its trace step)."""
    step = ev.step
    entries = [(step.text, step.logprob), *((t.text, t.logprob) for t in step.top_logprobs)]
    return [_logprob({"token": t, "logprob": lp, "bytes": t.encode()}) for t, lp in entries]


def token_response(text: str, ev: TokenEvent, logprobs: bool) -> CompletionResponse:
    """The response of one streamed token: ``text`` so far, its ``delta``, its source and,
    when asked, its logprobs."""
    return CompletionResponse(
        text=text,
        delta=ev.text,
        additional_kwargs={"source": ev.source},
        logprobs=[step_logprobs(ev)] if logprobs else None,
    )


def as_chat(c: CompletionResponse, message: ChatMessage | None = None) -> ChatResponse:
    """``c`` as a chat response (``message``: its message when not plain text, e.g. with
    tool calls)."""
    return ChatResponse(
        message=message or ChatMessage(role=MessageRole.ASSISTANT, content=c.text),
        delta=c.delta,
        additional_kwargs=c.additional_kwargs,
        raw=c.raw,
        logprobs=c.logprobs,
    )
