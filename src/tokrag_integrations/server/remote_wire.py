"""What travels between :class:`~.client.RemoteModel` and a ``tokrag serve`` server: a core
call as a ``chat.completions.create`` body (:func:`request_body`), and the server's answers
read back into the core's types, checked (:func:`answer`, :class:`Parser` for a stream,
:func:`model_info`): a body that is not the server's format raises :class:`~.remote_guards.Malformed`
naming what is wrong.

A call's sampling keywords travel as OpenAI's ``temperature`` / ``top_p`` / ``seed`` and
vLLM's ``top_k``; ``top_logprobs`` as ``logprobs: true`` with ``top_logprobs``; a constraint
spec as ``response_format`` (JSON) or ``tokrag.constraint`` (regex, grammar); ``tools`` and
``tool_choice`` as OpenAI's. The answer's text is the raw decoded text (tool-call markup
included, as a local decode gives it), rebuilt from the trace when the server parsed a call
into ``tool_calls``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..prompts import as_passages
from ..results import GenerationResult, TokenEvent
from ..trace import Trace, TraceStep, json_data
from .remote_guards import Malformed

__all__ = ["CALL_KEYS", "Parser", "answer", "model_info", "request_body"]

#: The core's keyword arguments a server request carries (``tools`` / ``tool_choice``: the
#: server renders and constrains the call).
CALL_KEYS = (
    "policy",
    "policy_options",
    "max_new_tokens",
    "stop",
    "messages",
    "system_prompt",
    "max_context_tokens",
    "prompt_format",
    "rendered",
    "citations",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "top_logprobs",
    "constraint",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)

#: Constraint specs a server takes, and the field each travels in.
_CONSTRAINT_FIELDS = {"json_object": "response_format", "json_schema": "response_format",
                      "regex": "tokrag.constraint", "grammar": "tokrag.constraint"}


def _tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call of an assistant turn in OpenAI's shape (``arguments`` a JSON string), from
    OpenAI's, a chat template's (``arguments`` an object) or the parsed ``{id, name,
    arguments}``."""
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    args = fn.get("arguments", {})
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": fn.get("name"),
                         "arguments": args if isinstance(args, str) else json.dumps(json_data(args))}}


def _turn(message: Mapping[str, Any]) -> dict[str, Any]:
    turn = dict(message)
    if turn.get("tool_calls"):
        turn["tool_calls"] = [_tool_call(c) for c in turn["tool_calls"]]
    return turn


def _tools(tools: Any) -> list[dict[str, Any]]:
    """``tools`` in OpenAI's shape: OpenAI dicts as they are, anything else through
    :func:`tokrag_integrations.structured.tool_spec` (pydantic classes, functions, LangChain
    and LlamaIndex tools)."""
    out = []
    for t in tools:
        if isinstance(t, Mapping) and t.get("type") == "function":
            out.append(json_data(dict(t)))
        else:
            from ..structured import tool_spec

            out.append(tool_spec(t))
    return out


def _tool_choice(choice: Any) -> Any:
    """``tool_choice`` as OpenAI's: the three words (``any`` is ``required``), a name as a
    named function, a dict as given."""
    if choice == "any":
        return "required"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def request_body(query: str | None, passages: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completions.create`` arguments of one core call: ``messages`` = system
    prompt + ``messages`` + the question (None: ``messages`` already ends with the turn to
    answer, a tool result), ``documents`` = the passages, ``tokrag`` = policy, options,
    prompt format, context budget, citations, a template-formatted prompt (``rendered``) and
    a regex / grammar constraint.

    Raises:
        TypeError: a keyword a server call cannot take, or a compiled constraint object (a
            server compiles its own: pass the spec, or ``tools=``).
    """
    unknown = sorted(set(kw) - set(CALL_KEYS) - {"batching"})
    if unknown:
        raise TypeError(f"a server call cannot take {', '.join(unknown)}")
    messages = []
    if kw.get("system_prompt") is not None:
        messages.append({"role": "system", "content": kw["system_prompt"]})
    messages += [_turn(m) for m in kw.get("messages") or []]
    if query is not None:
        messages.append({"role": "user", "content": query})
    tokrag: dict[str, Any] = {
        "policy": kw.get("policy", "tokrag"),
        "policy_options": json_data(dict(kw.get("policy_options") or {})),
        "trace": True,
    }
    for key in ("prompt_format", "max_context_tokens", "citations"):
        if kw.get(key) is not None:
            tokrag[key] = kw[key]
    rendered = kw.get("rendered")
    if rendered is not None:
        form = {"text": rendered.text} if rendered.text is not None else {"messages": rendered.messages}
        tokrag["rendered"] = {"context": rendered.context, **form}
        if rendered.passages is not None:
            tokrag["rendered"]["passages"] = documents(rendered.passages)
    extra: dict[str, Any] = {"tokrag": tokrag}
    if passages is not None and (passages or rendered is None):
        extra["documents"] = documents(as_passages(passages))
    body: dict[str, Any] = {
        "model": "tokrag",  # the server answers with the model it serves
        "messages": messages,
        "max_tokens": int(kw.get("max_new_tokens", 64)),
        "stop": list(kw.get("stop") or []),  # [] = none (absent: the server's default)
    }
    for key in ("temperature", "top_p", "seed"):
        if kw.get(key) is not None:
            body[key] = kw[key]
    if kw.get("top_k"):
        extra["top_k"] = int(kw["top_k"])  # vLLM's extension: not an openai client argument
    if kw.get("top_logprobs"):
        body["logprobs"], body["top_logprobs"] = True, int(kw["top_logprobs"])
    constraint = kw.get("constraint")
    if constraint is not None:
        where = _CONSTRAINT_FIELDS.get(constraint.get("type")) if isinstance(constraint, Mapping) else None
        if where is None:
            raise TypeError(
                "a server call takes constraint= as a spec dict ({'type': 'json_object'}, "
                "{'type': 'json_schema', 'json_schema': {...}}, {'type': 'regex', 'regex': ...} "
                f"or {{'type': 'grammar', 'grammar': ...}}), got {type(constraint).__name__}; "
                "the server compiles it (for tool calls pass tools= and tool_choice=)"
            )
        if where == "response_format":
            body["response_format"] = json_data(dict(constraint))
        else:
            tokrag["constraint"] = dict(constraint)
    if kw.get("tools"):
        body["tools"] = _tools(kw["tools"])
        if kw.get("tool_choice") is not None:
            body["tool_choice"] = _tool_choice(kw["tool_choice"])
        if kw.get("parallel_tool_calls") is not None:  # the server's default: OpenAI's (True)
            body["parallel_tool_calls"] = bool(kw["parallel_tool_calls"])
    body["extra_body"] = extra
    return body


def documents(passages: Any) -> list[dict[str, Any]]:
    """Core passages as the server's ``{text, score, metadata}`` documents."""
    return [
        {"text": p.text, "score": p.score, "metadata": json_data(dict(p.metadata))} for p in passages
    ]


def is_int(v: Any) -> bool:
    """Whether ``v`` is a JSON integer (not a boolean)."""
    return isinstance(v, int) and not isinstance(v, bool)


def model_info(data: Any) -> dict[str, Any]:
    """``/v1/models``' first model, checked (the fields the adapters read)."""
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise Malformed("lists no model under 'data'")
    info = models[0]
    window, eos = info.get("context_window"), info.get("eos_token_ids")
    if not isinstance(info.get("id"), str):
        raise Malformed("names its model with no string 'id'")
    if not is_int(window) or window < 1:
        raise Malformed(f"gives 'context_window' {str(window)[:40]}, not a positive integer")
    if not isinstance(info.get("chat"), bool):
        raise Malformed("gives no boolean 'chat'")
    if not isinstance(eos, list) or not all(is_int(t) for t in eos):
        raise Malformed("gives 'eos_token_ids' that is not a list of integers")
    return info


def answer(data: Any) -> GenerationResult:
    """A chat completion's body (with its ``tokrag`` object) as the core's result; its text
    is the trace's (the raw answer) when the server parsed it into ``tool_calls``."""
    if not isinstance(data, dict):
        raise Malformed(f"is a JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise Malformed("has no 'choices'")
    message = choices[0].get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str | None) or not isinstance(message, dict):
        raise Malformed("has no message text in choices[0]")
    result = result_of(data.get("tokrag"), text or "")
    if message.get("tool_calls"):
        result.text = result.trace.text
    return result


def result_of(tokrag: Any, text: str) -> GenerationResult:
    """A server answer's ``tokrag`` object (with its trace) as the core's result."""
    if not isinstance(tokrag, dict):
        raise Malformed("has no 'tokrag' object")
    if not isinstance(tokrag.get("trace"), dict):
        raise Malformed("has no 'tokrag.trace' object")
    try:
        trace = Trace.from_dict(tokrag["trace"])
    except ValueError as exc:
        raise Malformed(f"holds a malformed trace ({exc})") from None
    return GenerationResult(text=text, trace=trace, token_ids=[s.token_id for s in trace.steps])


def _streamed_logprob(choice: dict[str, Any]) -> float | None:
    """The token's log-probability in a chunk's ``logprobs`` (sent when the call asked for
    ``top_logprobs``; the full alternatives come with the trace at the end)."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
        value = content[0].get("logprob")
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None


def plain(chunk: Any) -> Any:
    """A stream chunk as the JSON data it was sent as (the ``openai`` client wraps it)."""
    to_dict = getattr(chunk, "to_dict", None)
    return to_dict(warnings=False) if to_dict is not None else chunk


class Parser:
    """Chat-completion chunks -> :class:`TokenEvent` objects, then the result. A stream
    with more token events than the ``max_tokens`` it asked for is malformed."""

    def __init__(self, max_tokens: int) -> None:
        self.index = 0
        self.text = ""
        self.max_tokens = max_tokens

    def feed(self, chunk: Any) -> TokenEvent | GenerationResult | None:
        data = plain(chunk)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise Malformed("holds an event that is not a chat completion chunk")
        extra = data.get("tokrag")
        if not data["choices"] or extra is None:
            return None  # the opening role chunk, the usage chunk
        choice = data["choices"][0]
        if not isinstance(choice, dict) or not isinstance(extra, dict):
            raise Malformed("holds an event whose choice or 'tokrag' is not an object")
        if choice.get("finish_reason") is not None:
            return result_of(extra, self.text)
        delta = choice.get("delta")
        # The token's own text (tokrag.text): delta.content is empty while the server holds
        # back what may be a tool call.
        text = extra.get("text")
        if text is None:
            text = (delta.get("content") if isinstance(delta, dict) else None) or ""
        token_id, source = extra.get("token_id"), extra.get("source")
        if not isinstance(text, str) or not is_int(token_id) or not isinstance(source, str):
            raise Malformed("holds a token event without its text, 'token_id' and 'source'")
        if self.index >= self.max_tokens:
            raise Malformed(f"streams more tokens than the max_tokens={self.max_tokens} asked")
        self.text += text
        step = TraceStep(self.index, token_id, text, source, logprob=_streamed_logprob(choice))
        self.index += 1
        return TokenEvent(0, step.index, step.token_id, text, step.source, step)

    def unfinished(self) -> str:
        return f"ended after {self.index} token(s), before its last event (with the trace)"
