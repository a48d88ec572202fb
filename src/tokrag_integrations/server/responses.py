"""A chat completion's parts from the core's results: each choice's message (text, or
``tool_calls`` parsed from the answer), its ``finish_reason`` and OpenAI ``logprobs``, the
usage of all choices, and the ``tokrag`` object (provenance: policy, counts per source,
trace, sources, citations, warnings). Shared by the plain answer (:mod:`.app`) and the
stream (:mod:`.streaming`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from typing import Any

from ..adapters.translate import FINISH_REASONS, usage
from .schemas import ChatRequest

__all__ = [
    "choice", "logprob_entry", "openai_tool_calls", "tokrag_object", "total_usage",
    "tool_calls_of",
]


def tokrag_object(result: Any, req: ChatRequest, extra_warnings: list[str]) -> dict[str, Any]:
    """The response's ``tokrag`` object for one :class:`~tokrag_integrations.GenerationResult`:
    ``sources`` by their share of the answer's attention (``contribution``; None: not cited),
    then in prompt order (``rank``, which a citation's ``passage`` names); ``citations`` the
    answer's spans (:meth:`~tokrag_integrations.trace.Trace.citations_data`; [] where no token
    carries one); ``sampling`` the draw's settings (empty when greedy)."""
    tr = result.trace
    shares = dict(tr.contributions())
    return {
        "policy": tr.policy,
        "counts": tr.counts(),
        "stop_reason": tr.stop_reason,
        "prompt_tokens": dict(tr.prompt_tokens),
        "sampling": dict(getattr(tr, "sampling", None) or {}),
        "warnings": [*tr.warnings, *req.warnings, *extra_warnings],
        "sources": [
            {**asdict(tr.passages[i]), "contribution": shares.get(i)} for i in tr.passage_order()
        ],
        "citations": tr.citations_data(),
        "trace": tr.to_dict() if req.trace else None,
    }


def _top(alt: Any) -> dict[str, Any]:
    text = alt.text
    return {"token": text, "logprob": alt.logprob, "bytes": list(text.encode("utf-8"))}


def logprob_entry(step: Any) -> dict[str, Any]:
    """One streamed token (a :class:`~tokrag_integrations.trace.TraceStep`) in OpenAI's
    content-logprob shape: ``token``, ``logprob`` (under the distribution the token was taken
    from), ``bytes`` and ``top_logprobs``; the entry
    :attr:`~tokrag_integrations.GenerationResult.logprobs` gives for it in the whole answer."""
    return {**_top(step), "top_logprobs": [_top(a) for a in step.top_logprobs]}


def tool_calls_of(text: str, req: ChatRequest) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of an answer when the request may call tools (the calls as
    :func:`~tokrag_integrations.structured.parse_tool_calls` gives them; only the first when
    ``parallel_tool_calls`` is false); ``(text, [])`` otherwise."""
    if not req.calls_tools:
        return text, []
    from ..structured import parse_tool_calls

    content, calls = parse_tool_calls(text)
    names = {t["function"]["name"] for t in req.tools or ()}
    calls = [c for c in calls if c.get("name") in names]
    if not req.parallel_tool_calls:
        calls = calls[:1]
    return (content if calls else text), calls


def call_finish(result: Any) -> str:
    """``finish_reason`` of an answer holding tool calls: ``tool_calls``, or ``length`` when
    ``max_tokens`` cut it (a later call may be cut short; it stays in the content)."""
    return "length" if result.stop_reason == "length" else "tool_calls"


def openai_tool_calls(calls: list[dict[str, Any]], streamed: bool = False) -> list[dict[str, Any]]:
    """Parsed calls as OpenAI ``tool_calls`` (``arguments`` a JSON string; ``index`` in a
    stream's delta)."""
    out = []
    for i, c in enumerate(calls):
        call = {
            "id": c.get("id") or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c["name"],
                         "arguments": json.dumps(c.get("arguments") or {}, ensure_ascii=False)},
        }
        out.append({"index": i, **call} if streamed else call)
    return out


def choice(index: int, result: Any, req: ChatRequest, tokrag: dict[str, Any] | None) -> dict[str, Any]:
    """Choice ``index`` of a chat completion: the message (with ``tool_calls`` and
    ``finish_reason: "tool_calls"`` when the answer is a call), ``logprobs`` when asked, and
    its own ``tokrag`` object when given (``n`` > 1)."""
    content, calls = tool_calls_of(result.text, req)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish = FINISH_REASONS.get(result.stop_reason, "stop")
    if calls:
        message = {"role": "assistant", "content": content or None,
                   "tool_calls": openai_tool_calls(calls)}
        finish = call_finish(result)
    out: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": finish,
        "logprobs": {"content": result.logprobs, "refusal": None} if req.logprobs else None,
    }
    if tokrag is not None:
        out["tokrag"] = tokrag
    return out


def total_usage(results: list[Any]) -> dict[str, Any]:
    """The usage of a request's choices (OpenAI's rule: the prompt once, the completion
    tokens of every choice); each counted by :func:`~..adapters.translate.usage`."""
    first = usage(results[0])
    completion = sum(usage(r)["completion_tokens"] for r in results)
    return {**first, "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion}
