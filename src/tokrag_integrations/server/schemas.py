"""The body of ``POST /v1/chat/completions``, checked and split the way the core API takes it.

The body's shape is a pydantic model (:class:`ChatBody`, strict: a string is not a number);
:func:`parse_chat_request` validates the decoded JSON against it and turns it into a
:class:`ChatRequest`, or raises :class:`RequestError` with one sentence naming the field
(pydantic's first error, worded by :func:`_refusal`), which the app returns as an OpenAI-style
400 error. Before the model, :func:`check_json_values` refuses what no field takes anywhere in
the body (nesting past :data:`MAX_JSON_DEPTH`, NaN and out-of-range numbers, lone surrogates).
The OpenAI fields a greedy local decoder cannot honour (``temperature`` other than 0, ``n`` >
1, ``top_p`` < 1, penalties, log-probabilities, tools) are refused; fields it has no use for
(``user``, ``seed``, ``metadata``...) are ignored and named in the response's
``tokrag.warnings``. The conversation is split by the core's rule
(:func:`tokrag_integrations.adapters.chat.split_turns`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..adapters.chat import split_turns

__all__ = [
    "MAX_JSON_DEPTH", "ChatBody", "ChatRequest", "Limits", "RequestError", "parse_chat_request",
]


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


def _refuse(sentence: str) -> PydanticCustomError:
    """A refusal worded by the server; ``{where}`` becomes the field's path."""
    return PydanticCustomError("refused", sentence)


def _limits(info: ValidationInfo) -> Limits:
    return (info.context or {}).get("limits") or Limits()


def _at_most(value: Any, limit: int, what: str) -> Any:
    if value is not None and len(value) > limit:
        raise _refuse(
            f"'{{where}}' holds {len(value)} {what}, more than this server's limit of {limit}"
        )
    return value


class _Strict(BaseModel):
    """Strict types (``"4"`` is not an integer, ``1`` is not true), unknown keys refused with
    the keys the object takes."""

    model_config = ConfigDict(strict=True, extra="forbid")
    _what: ClassVar[str] = "it takes"

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(cls.model_fields))
            if unknown:
                raise _refuse(
                    f"'{{where}}' has unknown key(s) {', '.join(unknown)}; {cls._what} "
                    f"{', '.join(cls.model_fields)}"
                )
        return value


class Document(_Strict):
    """One of ``documents``: a string, or ``{text, metadata, score}``."""

    _what: ClassVar[str] = "a document takes"
    text: str
    metadata: dict[str, Any] | None = None
    score: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _string_or_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"text": value}
        if not isinstance(value, Mapping):
            raise _refuse(
                f"'{{where}}' must be a string or an object with 'text', got {_type_name(value)}"
            )
        return value

    def passage(self) -> Any:
        from ..prompts import Passage

        return Passage(self.text, score=self.score, metadata=dict(self.metadata or {}))


class RenderedTurn(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Rendered(_Strict):
    """``tokrag.rendered``: the RAG context as the caller's template formatted it."""

    context: str
    messages: list[RenderedTurn] | None = None
    text: str | None = None
    passages: list[Document] | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_form(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and (
            set(value) - set(cls.model_fields) or ("messages" in value) == ("text" in value)
        ):
            unknown = sorted(set(value) - set(cls.model_fields))
            raise _refuse(
                "'{where}' takes 'context', one of 'messages' (the template's turns as "
                "formatted) or 'text' (a finished prompt), and optionally 'passages'"
                + (f"; unknown key(s) {', '.join(unknown)}" if unknown else "")
            )
        return value

    @field_validator("passages", mode="before")
    @classmethod
    def _few_passages(cls, value: Any, info: ValidationInfo) -> Any:
        return _at_most(value, _limits(info).max_documents, "documents")

    @field_validator("messages", mode="before")
    @classmethod
    def _turns(cls, value: Any, info: ValidationInfo) -> Any:
        most = _limits(info).max_messages
        if not isinstance(value, list) or not value or len(value) > most:
            raise _refuse(f"'{{where}}' must be an array of 1 to {most} messages")
        return value

    @model_validator(mode="after")
    def _parts_make_up_context(self) -> Rendered:
        if self.passages is not None and "".join(p.text for p in self.passages) != self.context:
            raise _refuse("'{where}.passages' texts must make up '{where}.context', in order")
        return self

    def prompt(self) -> Any:
        from ..prompts import RenderedPrompt

        parts = None if self.passages is None else [d.passage() for d in self.passages]
        turns = None if self.messages is None else [t.model_dump() for t in self.messages]
        return RenderedPrompt(self.context, messages=turns, text=self.text, passages=parts)


class TokRAGFields(_Strict):
    """The request's ``tokrag`` object."""

    policy: str | None = None
    policy_options: dict[str, Any] | None = None
    filters: dict[str, Any] | None = None
    top_k: int | None = Field(None, ge=1, le=100)
    trace: bool | None = None
    citations: bool | None = None
    rendered: Rendered | None = None
    prompt_format: Literal["qa", "chat", "text"] | None = None
    max_context_tokens: int | None = Field(None, ge=1)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str | None, info: ValidationInfo) -> str | None:
        policies = (info.context or {}).get("policies")
        if value is not None and policies is not None and value not in policies:
            raise _refuse(f"unknown policy {value!r}; available: {', '.join(policies)}")
        return value

    @field_validator("policy_options")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & {"prompt_format", "rendered"})
        if reserved:
            raise _refuse(f"'{{where}}' cannot set {', '.join(reserved)}")
        return value


class Message(BaseModel):
    """One chat message; its content a string or a list of text parts."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(None, validate_default=True)
    tool_calls: Any = None

    @field_validator("content")
    @classmethod
    def _text(cls, content: Any, info: ValidationInfo) -> str:
        if isinstance(content, str):
            return content
        if content is None and info.data.get("role") == "assistant":
            return ""
        if not isinstance(content, list):
            raise _refuse(
                "{where} must be a string or a list of text parts, got " + _type_name(content)
            )
        parts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else part
            if not isinstance(text, str):
                kind = part.get("type") if isinstance(part, Mapping) else _type_name(part)
                raise _refuse(f"{{where}}[{j}] is a {kind!r} part; this server reads text parts only")
            parts.append(text)
        return "".join(parts)

    @model_validator(mode="after")
    def _no_tool_calls(self) -> Message:
        if self.role == "assistant" and self.tool_calls:
            raise _refuse("this server has no tool calling; {where} holds tool_calls")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


#: Fields a greedy decoder may take only at one value: (the value, why).
_FIXED = {
    "temperature": (0, "every policy decodes greedily (Tok-RAG compares the greedy choices of "
                       "two contexts)"),
    "top_p": (1, "every policy decodes greedily (Tok-RAG compares the greedy choices of two "
                 "contexts)"),
    "presence_penalty": (0, "penalties are not supported"),
    "frequency_penalty": (0, "penalties are not supported"),
    "n": (1, "greedy decoding gives one answer"),
}

#: OpenAI fields a greedy decoder without tools cannot honour (refused unless off).
_UNSUPPORTED = (
    "logprobs", "tools", "functions", "tool_choice", "function_call", "response_format",
    "top_logprobs",
)


class ChatBody(BaseModel):
    """The body of ``POST /v1/chat/completions`` (OpenAI's, with ``documents`` and ``tokrag``);
    other fields are kept in ``model_extra`` and named in a warning."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[Message]
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = Field(None, ge=1)
    logprobs: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    top_logprobs: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: list[str] | None = Field(None, max_length=4)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    documents: list[Document] | None = None
    tokrag: TokRAGFields | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _conversation(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, list) or not value:
            got = "an empty array" if isinstance(value, list) else _type_name(value)
            raise _refuse(f"'messages' must be a non-empty array of messages, got {got}")
        return _at_most(value, _limits(info).max_messages, "messages")

    @field_validator("documents", mode="before")
    @classmethod
    def _few_documents(cls, value: Any, info: ValidationInfo) -> Any:
        return _at_most(value, _limits(info).max_documents, "documents")

    @field_validator(*_FIXED)
    @classmethod
    def _fixed(cls, value: Any, info: ValidationInfo) -> Any:
        allowed, why = _FIXED[info.field_name]
        if value is not None and value != allowed:
            raise _refuse(f"'{{where}}' must be {allowed:g} or absent, got {value:g}: {why}")
        return value

    @field_validator(*_UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, False, [], "none"):
            raise _refuse(f"'{info.field_name}' is not supported by this server")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _within_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        high = _limits(info).max_tokens
        if value is not None and value > high:
            raise _refuse(f"'{{where}}' is {value}, more than this server's limit of {high} new tokens")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


#: How pydantic's error types read in a refusal: what the field must be.
_MUST_BE = {
    "string_type": "a string", "int_type": "an integer", "bool_type": "true or false",
    "float_type": "a number", "dict_type": "an object", "model_type": "an object",
    "list_type": "an array",
}


def _refusal(error: Mapping[str, Any]) -> RequestError:
    """One pydantic error as the server's 400: one sentence naming the field."""
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in error["loc"]).lstrip(".")
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "refused":
        message = error["msg"].replace("{where}", where)
    elif kind in _MUST_BE:
        message = f"'{where}' must be {_MUST_BE[kind]}, got {_type_name(got)}"
    elif kind == "greater_than_equal":
        message = f"'{where}' must be at least {ctx['ge']}, got {got}"
    elif kind == "less_than_equal":
        message = f"'{where}' must be at most {ctx['le']}, got {got}"
    elif kind == "literal_error":
        message = f"{where} must be {ctx['expected']}, got {got!r}"
    elif kind == "too_long":
        message = f"'{where}' holds {ctx['actual_length']} items; at most {ctx['max_length']}"
    elif kind == "missing":
        message = f"'{where}' is required"
    else:
        message = f"'{where}': {error['msg']}"
    return RequestError(message, where or None)


def parse_chat_request(body: Any, limits: Limits, policies: Sequence[str]) -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body against ``limits`` (:class:`ChatBody`,
    after :func:`check_json_values`) and split its conversation.

    Raises:
        RequestError: the first problem found, naming its field.
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the body must be a JSON object, got {_type_name(body)}")
    check_json_values(body)
    try:
        b = ChatBody.model_validate(body, context={"limits": limits, "policies": policies})
    except ValidationError as exc:
        raise _refusal(exc.errors()[0]) from None
    try:
        turns = split_turns([m.model_dump(include={"role", "content"}) for m in b.messages])
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    if not turns.query.strip():
        raise RequestError("the last user message is empty; ask a question", "messages")
    t = b.tokrag or TokRAGFields()
    if t.rendered is not None and b.documents is not None:
        raise RequestError("give 'documents' or 'tokrag.rendered', not both", "tokrag.rendered")
    req = ChatRequest(
        query=turns.query,
        history=turns.history,
        system_prompt=turns.system_prompt,
        documents=None if b.documents is None else [d.passage() for d in b.documents],
        max_tokens=b.max_completion_tokens or b.max_tokens,
        stop=b.stop,
        stream=bool(b.stream),
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        model=b.model,
        policy=t.policy,
        options=dict(t.policy_options or {}),
        filters=t.filters or None,
        top_k=t.top_k,
        trace=True if t.trace is None else t.trace,
        citations=t.citations,
        rendered=None if t.rendered is None else t.rendered.prompt(),
        prompt_format=t.prompt_format,
        max_context_tokens=t.max_context_tokens,
    )
    if b.model_extra:
        req.warnings.append(
            f"ignored field(s) this server does not use: {', '.join(sorted(b.model_extra))}"
        )
    return req
