"""The body of ``POST /v1/chat/completions``, checked and split the way the core API takes it.

The body's shape is a pydantic model (:class:`ChatBody`, strict: a string is not a number);
:func:`parse_chat_request` validates the decoded JSON against it and turns it into a
:class:`ChatRequest`, or raises :class:`~.refusals.RequestError` with one sentence naming the
field (pydantic's first error, worded by :func:`~.refusals.refusal`), which the app returns as
an OpenAI-style 400 error. Before the model, :func:`~.refusals.check_json_values` refuses what
no field takes anywhere in the body (nesting past :data:`~.refusals.MAX_JSON_DEPTH`, NaN and
out-of-range numbers, lone surrogates).

Honoured: sampling (``temperature`` in [0, 2], ``top_p``, vLLM's ``top_k``, ``seed``),
``logprobs`` / ``top_logprobs``, ``n`` (up to :attr:`~.refusals.Limits.max_n`),
``response_format`` and ``tools`` / ``tool_choice`` (the shapes of :mod:`.openai_fields`).
Refused unless off: penalties and the deprecated ``functions`` / ``function_call``. Fields the
server has no use for (``user``, ``metadata``...) are ignored and named in the response's
``tokrag.warnings``. A conversation without tools is split here by the core's rule
(:func:`tokrag_integrations.adapters.chat.split_turns`); one with tools or tool turns is kept
whole (``conversation``) for the service, which renders it with the model's tokenizer.
"""

from __future__ import annotations

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

from ..adapters.chat import split_turns
from .openai_fields import ConstraintField, Message, ResponseFormat, Tool, checked_tool_choice
from .refusals import (
    Limits,
    RequestError,
    Strict,
    at_most,
    check_json_values,
    limits_of,
    refusal,
    refuse,
    type_name,
)

__all__ = ["ChatBody", "ChatRequest", "parse_chat_request", "split_conversation"]

#: The largest ``seed`` (the engine's noise hashes a signed 64-bit seed; ``n`` choices use
#: ``seed`` .. ``seed + n - 1``).
MAX_SEED = 2**63 - 1


@dataclass
class ChatRequest:
    """One chat request, split for :func:`tokrag_integrations.generate`."""

    query: str
    """The content of the final user turn(s) (set by the service when tools are rendered)."""
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
    """``tokrag.top_k``: passages retrieved from the store (sampling's ``top_k`` is in
    ``sampling``)."""
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
    sampling: dict[str, Any] = field(default_factory=dict)
    """The engine's sampling keywords given (``temperature``, ``top_p``, ``top_k``, ``seed``)."""
    logprobs: bool = False
    """Whether each choice carries OpenAI ``logprobs``."""
    top_logprobs: int = 0
    """Alternatives recorded per token (0..20)."""
    n: int = 1
    """Choices to return; choice ``i`` is drawn with ``seed + i`` when a seed is given."""
    constraint: dict[str, Any] | None = None
    """The constraint spec of ``response_format`` or ``tokrag.constraint`` (None: free text)."""
    tools: list[dict[str, Any]] | None = None
    """``tools`` in OpenAI's shape (None: no tools)."""
    tool_choice: str = "auto"
    """``auto``, ``none``, ``required`` or the name of the one tool to call."""
    parallel_tool_calls: bool = True
    conversation: list[dict[str, Any]] | None = None
    """The whole conversation, kept when it has tools or tool turns: the service renders it
    (:func:`tokrag_integrations.structured.render_tools`) and splits it."""
    warnings: list[str] = field(default_factory=list)

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be a tool call (tools given, ``tool_choice`` not none)."""
        return bool(self.tools) and self.tool_choice != "none"


class Document(Strict):
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
            raise refuse(
                f"'{{where}}' must be a string or an object with 'text', got {type_name(value)}"
            )
        return value

    def passage(self) -> Any:
        from ..prompts import Passage

        return Passage(self.text, score=self.score, metadata=dict(self.metadata or {}))


class RenderedTurn(Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class Rendered(Strict):
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
            raise refuse(
                "'{where}' takes 'context', one of 'messages' (the template's turns as "
                "formatted) or 'text' (a finished prompt), and optionally 'passages'"
                + (f"; unknown key(s) {', '.join(unknown)}" if unknown else "")
            )
        return value

    @field_validator("passages", mode="before")
    @classmethod
    def _few_passages(cls, value: Any, info: ValidationInfo) -> Any:
        return at_most(value, limits_of(info).max_documents, "documents")

    @field_validator("messages", mode="before")
    @classmethod
    def _turns(cls, value: Any, info: ValidationInfo) -> Any:
        most = limits_of(info).max_messages
        if not isinstance(value, list) or not value or len(value) > most:
            raise refuse(f"'{{where}}' must be an array of 1 to {most} messages")
        return value

    @model_validator(mode="after")
    def _parts_make_up_context(self) -> Rendered:
        if self.passages is not None and "".join(p.text for p in self.passages) != self.context:
            raise refuse("'{where}.passages' texts must make up '{where}.context', in order")
        return self

    def prompt(self) -> Any:
        from ..prompts import RenderedPrompt

        parts = None if self.passages is None else [d.passage() for d in self.passages]
        turns = None if self.messages is None else [t.model_dump() for t in self.messages]
        return RenderedPrompt(self.context, messages=turns, text=self.text, passages=parts)


class TokRAGFields(Strict):
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
    constraint: ConstraintField | None = None

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str | None, info: ValidationInfo) -> str | None:
        policies = (info.context or {}).get("policies")
        if value is not None and policies is not None and value not in policies:
            raise refuse(f"unknown policy {value!r}; available: {', '.join(policies)}")
        return value

    @field_validator("policy_options")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(set(value or ()) & {"prompt_format", "rendered"})
        if reserved:
            raise refuse(f"'{{where}}' cannot set {', '.join(reserved)}")
        return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = None


#: Fields the server takes only at one value: (the value, why).
_FIXED = {
    "presence_penalty": (0, "penalties are not supported"),
    "frequency_penalty": (0, "penalties are not supported"),
}

#: Deprecated OpenAI fields, refused unless off: what replaces them.
_DEPRECATED = {"functions": "tools", "function_call": "tool_choice"}


class ChatBody(BaseModel):
    """The body of ``POST /v1/chat/completions`` (OpenAI's, with vLLM's ``top_k``,
    ``documents`` and ``tokrag``); other fields are kept in ``model_extra`` and named in a
    warning."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[Message]
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
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
            got = "an empty array" if isinstance(value, list) else type_name(value)
            raise refuse(f"'messages' must be a non-empty array of messages, got {got}")
        return at_most(value, limits_of(info).max_messages, "messages")

    @field_validator("documents", mode="before")
    @classmethod
    def _few_documents(cls, value: Any, info: ValidationInfo) -> Any:
        return at_most(value, limits_of(info).max_documents, "documents")

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any, info: ValidationInfo) -> Any:
        return at_most(value, limits_of(info).max_tools, "tools")

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return None if value is None else checked_tool_choice(value)

    @field_validator(*_FIXED)
    @classmethod
    def _fixed(cls, value: Any, info: ValidationInfo) -> Any:
        allowed, why = _FIXED[info.field_name]
        if value is not None and value != allowed:
            raise refuse(f"'{{where}}' must be {allowed:g} or absent, got {value:g}: {why}")
        return value

    @field_validator(*_DEPRECATED)
    @classmethod
    def _deprecated(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, [], "none"):
            raise refuse(f"'{info.field_name}' is OpenAI's deprecated form; this server takes "
                         f"'{_DEPRECATED[info.field_name]}'")
        return value

    @field_validator("n")
    @classmethod
    def _few_choices(cls, value: int | None, info: ValidationInfo) -> int | None:
        most = limits_of(info).max_n
        if value is not None and value > most:
            raise refuse(f"'{{where}}' is {value}, more than this server's limit of {most} choices")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _within_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        high = limits_of(info).max_tokens
        if value is not None and value > high:
            raise refuse(f"'{{where}}' is {value}, more than this server's limit of {high} new tokens")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    def check_together(self) -> None:
        """Refuse fields that only make sense together (OpenAI's rules), naming the field
        (after validation: a RequestError raised inside a validator would lose its field)."""
        if self.top_logprobs and not self.logprobs:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.seed is not None and self.n is not None and self.seed + self.n - 1 > MAX_SEED:
            raise RequestError(f"'seed' + 'n' - 1 must be at most {MAX_SEED} (choice i is drawn "
                               "with seed + i)", "seed")
        if self.tool_choice is not None and not self.tools:
            raise RequestError("'tool_choice' needs 'tools'", "tool_choice")
        names = [t.function.name for t in self.tools or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise RequestError(f"'tools' names {', '.join(twice)} more than once", "tools")
        named = self.tool_choice
        if named not in (None, "auto", "none", "required") and named not in names:
            raise RequestError(f"'tool_choice' names the function {named!r}, which is not among "
                               f"'tools' ({', '.join(names)})", "tool_choice.function.name")
        formatted = self.response_format is not None and self.response_format.type != "text"
        constrained = self.tokrag is not None and self.tokrag.constraint is not None
        if formatted and constrained:
            raise RequestError("give 'response_format' or 'tokrag.constraint', not both",
                               "tokrag.constraint")
        if (formatted or constrained) and self.tools and self.tool_choice != "none":
            where = "response_format" if formatted else "tokrag.constraint"
            raise RequestError(f"'{where}' cannot be combined with 'tools' (the answer is either "
                               "a tool call or the format); set tool_choice to 'none' or drop "
                               "one", where)

    def constraint(self) -> dict[str, Any] | None:
        """The constraint spec the answer follows (None: free text)."""
        if self.response_format is not None:
            spec = self.response_format.spec()
            if spec is not None:
                return spec
        if self.tokrag is not None and self.tokrag.constraint is not None:
            return self.tokrag.constraint.spec()
        return None

    def sampling(self) -> dict[str, Any]:
        """The engine's sampling keywords given (vLLM's ``top_k=-1`` is 0: no cut)."""
        given = {"temperature": self.temperature, "top_p": self.top_p,
                 "top_k": None if self.top_k is None else max(self.top_k, 0), "seed": self.seed}
        return {k: v for k, v in given.items() if v is not None}

    def turns(self) -> tuple[list[dict[str, Any]], bool]:
        """The conversation as turns, and whether it has tool calls or tool results."""
        names = {c.id: c.function.name for m in self.messages for c in m.tool_calls or ()}
        turns = [m.as_dict(names) for m in self.messages]
        return turns, any(m.role == "tool" or m.tool_calls for m in self.messages)


def parse_chat_request(body: Any, limits: Limits, policies: Sequence[str]) -> ChatRequest:
    """Check a decoded ``/v1/chat/completions`` body against ``limits`` (:class:`ChatBody`,
    after :func:`~.refusals.check_json_values`) and split its conversation (kept whole for
    the service when it has tools or tool turns).

    Raises:
        RequestError: the first problem found, naming its field.
    """
    if not isinstance(body, Mapping):
        raise RequestError(f"the body must be a JSON object, got {type_name(body)}")
    check_json_values(body)
    try:
        b = ChatBody.model_validate(body, context={"limits": limits, "policies": policies})
    except ValidationError as exc:
        raise refusal(exc.errors()[0]) from None
    b.check_together()
    t = b.tokrag or TokRAGFields()
    if t.rendered is not None and b.documents is not None:
        raise RequestError("give 'documents' or 'tokrag.rendered', not both", "tokrag.rendered")
    turns, tool_turns = b.turns()
    req = ChatRequest(
        query="",
        history=[],
        system_prompt=None,
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
        sampling=b.sampling(),
        logprobs=bool(b.logprobs),
        top_logprobs=b.top_logprobs or 0,
        n=b.n or 1,
        constraint=b.constraint(),
        tools=[tool.as_dict() for tool in b.tools] if b.tools else None,
        tool_choice=b.tool_choice or "auto",
        parallel_tool_calls=b.parallel_tool_calls is not False,
    )
    if req.tools or tool_turns:
        if t.rendered is not None:
            raise RequestError("'tokrag.rendered' cannot be combined with tools or tool turns: "
                               "the server renders those", "tokrag.rendered")
        req.conversation = turns
    else:
        split_conversation(req, turns)
    if b.model_extra:
        req.warnings.append(
            f"ignored field(s) this server does not use: {', '.join(sorted(b.model_extra))}"
        )
    return req


def split_conversation(req: ChatRequest, turns: list[dict[str, Any]]) -> None:
    """Fill ``req``'s query, history and system prompt from plain ``turns`` (roles system,
    developer, user, assistant; string contents) by the core's rule.

    Raises:
        RequestError: (``messages``) the conversation does not end with a user message, or
            its last user message is empty.
    """
    try:
        parts = split_turns(turns)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    if not parts.query.strip():
        raise RequestError("the last user message is empty; ask a question", "messages")
    req.query, req.history, req.system_prompt = parts.query, parts.history, parts.system_prompt
