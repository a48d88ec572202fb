"""The body of ``POST /v1/chat/completions``, checked and split the way the core API takes it.

Framework-free (no FastAPI import): :func:`parse_chat_request` turns the decoded JSON body into
a :class:`ChatRequest` or raises :class:`RequestError` with one sentence naming the field, which
the app returns as an OpenAI-style 400 error. The OpenAI fields a greedy local decoder cannot
honour (``temperature`` other than 0, ``n`` > 1, ``top_p`` < 1, penalties, log-probabilities,
tools) are refused; fields it has no use for (``user``, ``seed``, ``metadata``...) are ignored
and named in the response's ``tokrag.warnings``.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_JSON_DEPTH", "ChatRequest", "Limits", "RequestError", "parse_chat_request",
    "parse_documents",
]

#: Keys of the request's ``tokrag`` object.
TOKRAG_KEYS = (
    "policy", "policy_options", "filters", "top_k", "trace", "citations", "rendered",
    "prompt_format", "max_context_tokens",
)

#: OpenAI fields a greedy decoder without tools cannot honour (refused unless off).
_UNSUPPORTED = (
    "logprobs",
    "tools",
    "functions",
    "tool_choice",
    "function_call",
    "response_format",
    "top_logprobs",
)

#: OpenAI fields the server takes; others are ignored with a warning.
_KNOWN = {
    *_UNSUPPORTED,
    *("model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream"),
    *("stream_options", "temperature", "top_p", "n", "presence_penalty", "frequency_penalty"),
    *("documents", "tokrag"),
}


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400 unless said), ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": None}}


#: Deepest nesting of arrays and objects in a request body (an OpenAI chat body needs 4).
MAX_JSON_DEPTH = 32


def too_deep(where: str | None = None) -> RequestError:
    """The 400 of a body (or of its field ``where``) nested deeper than :data:`MAX_JSON_DEPTH`."""
    return RequestError(
        f"{where or 'the body'} nests arrays and objects deeper than this server's limit of "
        f"{MAX_JSON_DEPTH} levels", where
    )


def _path(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _number(value: Any, where: str) -> None:
    """Refuse NaN, the infinities (Python's JSON decoder reads ``NaN`` and ``Infinity``) and
    integers a float cannot hold (``10**400``): no field of the server takes them."""
    if isinstance(value, float) and not math.isfinite(value):
        got = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        got = f"an integer of {len(str(abs(value)))} digits"
    else:
        return
    raise RequestError(f"'{where}' must be a finite number of at most "
                       f"{sys.float_info.max:.1e} in size, got {got}", where)


def _unicode(text: str, where: str, what: str = "") -> None:
    """Refuse a string with a lone surrogate (JSON's ``"\\ud800"`` escape decodes to one): no
    tokenizer, database or client takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = f"'{where}'" if where else "the body"
        raise RequestError(
            f"{name}{what} is not valid Unicode: it holds the lone surrogate "
            f"{ascii(text[exc.start])} at position {exc.start}", where or None
        ) from None


def check_json_values(body: Any) -> None:
    """Refuse (:class:`RequestError` naming the field) a decoded body nested deeper than
    :data:`MAX_JSON_DEPTH` (deep metadata would fail in the response, after the whole decode),
    or holding a number out of range (NaN, infinite, too large for a float) or a string that
    is not valid Unicode."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, Mapping):
            items: Any = value.items()
            for key in value:
                _unicode(key, where, " has a key that")
        elif isinstance(value, list):
            items = enumerate(value)
        elif isinstance(value, str):
            _unicode(value, where)
            continue
        else:
            _number(value, where)
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(where or None)
        stack.extend((v, _path(where, k), depth + 1) for k, v in items)


@dataclass
class Limits:
    """Per-request limits of the server (``tokrag serve`` flags of the same names)."""

    max_tokens: int = 512
    """Largest ``max_tokens`` a request may ask for."""
    max_documents: int = 32
    """Most ``documents`` in one request."""
    max_messages: int = 64
    """Most chat messages in one request."""
    max_body_bytes: int = 1_000_000
    """Largest request body (checked by the app before the JSON is read)."""


@dataclass
class ChatRequest:
    """One chat request, split for :func:`tokrag_integrations.generate`."""

    query: str
    """The content of the final user turn(s)."""
    history: list[dict[str, str]]
    """Earlier user/assistant turns (``messages=`` of the core)."""
    system_prompt: str | None
    """The system (and developer) messages joined, or None for the core's default."""
    documents: list[Any] | None
    """Passages given in the body (None: not given, the server's store is asked if it has one)."""
    max_tokens: int | None
    stop: list[str] | None
    """None: the server's default stop strings."""
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    policy: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """The policy options (``tokrag.policy_options``)."""
    filters: Any = None
    top_k: int | None = None
    trace: bool = True
    """Whether the response carries the full token trace (``tokrag.trace``)."""
    citations: bool | None = None
    """``tokrag.citations``: the core's ``citations=`` (None: the policy's default)."""
    rendered: Any = None
    """``tokrag.rendered`` as a :class:`~tokrag_integrations.prompts.RenderedPrompt`: the RAG
    context as the caller's template formatted it (``messages`` are then the pure context)."""
    prompt_format: str | None = None
    """``tokrag.prompt_format`` (``qa``, ``chat``, ``text``; None: the core's ``qa``)."""
    max_context_tokens: int | None = None
    warnings: list[str] = field(default_factory=list)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array"}
    return names.get(type(value), "object" if type(value) is dict else type(value).__name__)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: What :func:`_typed` checks, by the name its error gives.
_KINDS = {
    "a string": lambda v: isinstance(v, str),
    "an object": lambda v: isinstance(v, Mapping),
    "true or false": lambda v: isinstance(v, bool),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": _is_number,
}


def _typed(value: Any, kind: str, where: str) -> Any:
    """``value``, or a 400 when it is not ``kind`` (a key of :data:`_KINDS`) naming ``where``."""
    if not _KINDS[kind](value):
        raise RequestError(f"'{where}' must be {kind}, got {_type_name(value)}", where)
    return value


def _flag(body: Mapping[str, Any], key: str, where: str) -> bool:
    value = body.get(key)
    return False if value is None else _typed(value, "true or false", where)


def _int(body: Mapping[str, Any], key: str, low: int, high: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    _typed(value, "an integer", key)
    if value < low:
        raise RequestError(f"'{key}' must be at least {low}, got {value}", key)
    if high is not None and value > high:
        raise RequestError(
            f"'{key}' is {value}, more than this server's limit of {high} new tokens", key
        )
    return value


def _number_equal(body: Mapping[str, Any], key: str, allowed: float, why: str) -> None:
    value = body.get(key)
    if value is not None and _typed(value, "a number", key) != allowed:
        raise RequestError(f"'{key}' must be {allowed:g} or absent, got {value:g}: {why}", key)


def _content(message: Mapping[str, Any], i: int) -> str:
    content = message.get("content")
    where = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and message.get("role") == "assistant":
        return ""
    if not isinstance(content, list):
        raise RequestError(
            f"{where} must be a string or a list of text parts, got {_type_name(content)}", where
        )
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and part.get("type") == "text":
            part = part.get("text")
        if not isinstance(part, str):
            kind = content[j].get("type") if isinstance(content[j], Mapping) else _type_name(part)
            raise RequestError(
                f"{where}[{j}] is a {kind!r} part; this server reads text parts only", where
            )
        parts.append(part)
    return "".join(parts)


def _messages(value: Any, limits: Limits) -> tuple[str, list[dict[str, str]], str | None]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _type_name(value)
        raise RequestError(
            f"'messages' must be a non-empty array of messages, got {got}", "messages"
        )
    if len(value) > limits.max_messages:
        raise RequestError(
            f"'messages' holds {len(value)} messages, more than this server's limit of "
            f"{limits.max_messages}",
            "messages",
        )
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise RequestError(
                f"{where} must be an object with 'role' and 'content', got {_type_name(m)}", where
            )
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise RequestError(
                f"{where}.role must be 'system', 'developer', 'user' or 'assistant', got "
                f"{role!r} (this server has no tool calling)",
                f"{where}.role",
            )
        if role == "assistant" and m.get("tool_calls"):
            raise RequestError(f"this server has no tool calling; {where} holds tool_calls", where)
        text = _content(m, i)
        if role in ("user", "assistant"):
            turns.append({"role": role, "content": text})
        elif text.strip():
            system.append(text)
    if not turns or turns[-1]["role"] != "user":
        raise RequestError(
            "the last message must be a user message: the server answers it", "messages"
        )
    tail: list[str] = []
    while turns and turns[-1]["role"] == "user":
        tail.insert(0, turns.pop()["content"])
    query = "\n\n".join(t for t in tail if t.strip())
    if not query.strip():
        raise RequestError("the last user message is empty; ask a question", "messages")
    return query, turns, "\n\n".join(system) or None


def parse_documents(value: Any, limits: Limits, param: str = "documents") -> list[Any]:
    """``documents``: strings or ``{text, metadata, score}`` objects -> core ``Passage`` list."""
    from ..prompts import Passage

    if not isinstance(value, list):
        raise RequestError(
            f"'{param}' must be an array of strings or {{text, metadata, score}} objects, got "
            f"{_type_name(value)}",
            param,
        )
    if len(value) > limits.max_documents:
        raise RequestError(
            f"'{param}' holds {len(value)} documents, more than this server's limit of "
            f"{limits.max_documents}",
            param,
        )
    out = []
    for i, d in enumerate(value):
        where = f"{param}[{i}]"
        if isinstance(d, str):
            out.append(Passage(d))
            continue
        if not isinstance(d, Mapping):
            raise RequestError(
                f"{where} must be a string or an object with 'text', got {_type_name(d)}", where
            )
        unknown = sorted(set(d) - {"text", "metadata", "score"})
        if unknown:
            raise RequestError(
                f"{where} has unknown key(s) {', '.join(unknown)}; a document takes text, "
                "metadata and score",
                where,
            )
        text = _typed(d.get("text"), "a string", f"{where}.text")
        meta, score = d.get("metadata"), d.get("score")
        if meta is not None:
            _typed(meta, "an object", f"{where}.metadata")
        if score is not None:
            score = float(_typed(score, "a number", f"{where}.score"))
        out.append(Passage(text, score=score, metadata=dict(meta or {})))
    return out


def _stop(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise RequestError(
            f"'stop' must be a string or an array of strings, got {_type_name(value)}", "stop"
        )
    if len(value) > 4:
        raise RequestError(f"'stop' holds {len(value)} strings; at most 4", "stop")
    return list(value)


def _rendered(value: Any, limits: Limits) -> Any:
    """``tokrag.rendered``: ``{"context", "messages" | "text", "passages"?}`` -> a
    ``RenderedPrompt`` (``passages``: documents whose texts make up ``context``, in order)."""
    from ..prompts import RenderedPrompt

    where = "tokrag.rendered"
    _typed(value, "an object", where)
    unknown = sorted(set(value) - {"context", "messages", "text", "passages"})
    if unknown or ("messages" in value) == ("text" in value):
        raise RequestError(
            f"'{where}' takes 'context', one of 'messages' (the template's turns as "
            "formatted) or 'text' (a finished prompt), and optionally 'passages'"
            + (f"; unknown key(s) {', '.join(unknown)}" if unknown else ""), where
        )
    context = _typed(value.get("context"), "a string", f"{where}.context")
    parts = value.get("passages")
    if parts is not None:
        parts = parse_documents(parts, limits, f"{where}.passages")
        if "".join(p.text for p in parts) != context:
            raise RequestError(
                f"'{where}.passages' texts must make up '{where}.context', in order",
                f"{where}.passages",
            )
    if "text" in value:
        text = _typed(value["text"], "a string", f"{where}.text")
        return RenderedPrompt(context, text=text, passages=parts)
    turns = value["messages"]
    if not isinstance(turns, list) or not turns or len(turns) > limits.max_messages:
        raise RequestError(
            f"'{where}.messages' must be an array of 1 to {limits.max_messages} messages",
            f"{where}.messages",
        )
    out = []
    for i, m in enumerate(turns):
        w = f"{where}.messages[{i}]"
        role = _typed(m, "an object", w).get("role")
        if role not in ("system", "user", "assistant"):
            raise RequestError(f"{w}.role must be 'system', 'user' or 'assistant', got {role!r}", w)
        out.append({"role": role, "content": _typed(m.get("content"), "a string", f"{w}.content")})
    return RenderedPrompt(context, messages=out, passages=parts)


def _tokrag(value: Any, req: ChatRequest, policies: Sequence[str], limits: Limits) -> None:
    if value is None:
        return
    _typed(value, "an object", "tokrag")
    unknown = sorted(set(value) - set(TOKRAG_KEYS))
    if unknown:
        raise RequestError(
            f"'tokrag' has unknown key(s) {', '.join(unknown)}; it takes {', '.join(TOKRAG_KEYS)}",
            "tokrag",
        )
    policy = value.get("policy")
    if policy is not None:
        if _typed(policy, "a string", "tokrag.policy") not in policies:
            raise RequestError(
                f"unknown policy {policy!r}; available: {', '.join(policies)}", "tokrag.policy"
            )
        req.policy = policy
    options = value.get("policy_options")
    if options is not None:  # checked by the policy registry later
        where = "tokrag.policy_options"
        reserved = sorted(set(_typed(options, "an object", where)) & {"prompt_format", "rendered"})
        if reserved:
            raise RequestError(f"'{where}' cannot set {', '.join(reserved)}", where)
        req.options = dict(options)
    filters = value.get("filters")
    if filters is not None and not isinstance(filters, Mapping):
        raise RequestError(
            f"'tokrag.filters' must be an object such as {{\"file_name\": \"guide.md\"}}, got "
            f"{_type_name(filters)}",
            "tokrag.filters",
        )
    req.filters = dict(filters) if filters else None
    req.top_k = _int(value, "top_k", 1, 100)
    if value.get("trace") is not None:
        req.trace = _typed(value["trace"], "true or false", "tokrag.trace")
    if value.get("citations") is not None:
        req.citations = _typed(value["citations"], "true or false", "tokrag.citations")
    if value.get("rendered") is not None:
        if req.documents is not None:
            raise RequestError("give 'documents' or 'tokrag.rendered', not both", "tokrag.rendered")
        req.rendered = _rendered(value["rendered"], limits)
    fmt = value.get("prompt_format")
    if fmt is not None and fmt not in ("qa", "chat", "text"):
        raise RequestError(
            f"'tokrag.prompt_format' must be 'qa', 'chat' or 'text', got {fmt!r}",
            "tokrag.prompt_format",
        )
    req.prompt_format = fmt
    req.max_context_tokens = _int(value, "max_context_tokens", 1, None)


def parse_chat_request(body: Any, limits: Limits, policies: Sequence[str]) -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body against ``limits``.

    Raises:
        RequestError: the first problem found, naming its field.
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the body must be a JSON object, got {_type_name(body)}")
    check_json_values(body)
    model = body.get("model")
    if model is not None:
        _typed(model, "a string", "model")
    query, history, system_prompt = _messages(body.get("messages"), limits)
    greedy = "every policy decodes greedily (Tok-RAG compares the greedy choices of two contexts)"
    _number_equal(body, "temperature", 0, greedy)
    _number_equal(body, "top_p", 1, greedy)
    _number_equal(body, "presence_penalty", 0, "penalties are not supported")
    _number_equal(body, "frequency_penalty", 0, "penalties are not supported")
    n = _int(body, "n", 1, None)
    if n is not None and n != 1:
        raise RequestError(f"'n' must be 1, got {n}: greedy decoding gives one answer", "n")
    for key in _UNSUPPORTED:
        if body.get(key) not in (None, False, [], "none"):
            raise RequestError(f"'{key}' is not supported by this server", key)
    max_tokens = _int(body, "max_completion_tokens", 1, limits.max_tokens)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limits.max_tokens)
    opts = body.get("stream_options")
    opts = {} if opts is None else _typed(opts, "an object", "stream_options")
    documents = body.get("documents")
    req = ChatRequest(
        query=query,
        history=history,
        system_prompt=system_prompt,
        documents=None if documents is None else parse_documents(documents, limits),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stream=_flag(body, "stream", "stream"),
        include_usage=_flag(opts, "include_usage", "stream_options.include_usage"),
        model=model,
    )
    _tokrag(body.get("tokrag"), req, policies, limits)
    ignored = sorted(k for k in body if k not in _KNOWN)
    if ignored:
        req.warnings.append(f"ignored field(s) this server does not use: {', '.join(ignored)}")
    return req
