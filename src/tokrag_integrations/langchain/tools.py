"""``ChatTokRAG.bind_tools``: LangChain tools, tool calls and tool results as the
:mod:`tokrag_integrations.structured` helpers take them, and back.

Tools are rendered into the prompt by :func:`~tokrag_integrations.structured.render_tools`
(the model's own chat template when it renders tools, else one system block saying how to
call); the call is constrained by :func:`~tokrag_integrations.structured.tool_call_constraint`
(``tool_choice``: ``"auto"`` leaves the model free until it starts a call, ``"required"`` /
``"any"`` / ``True`` force a call of one of the tools, a tool's name that tool, ``"none"`` no
call); the answer's calls, parsed by :func:`~tokrag_integrations.structured.parse_tool_calls`,
are ``AIMessage.tool_calls`` (streamed as ``tool_call_chunks`` on the last chunk); earlier
calls (``AIMessage.tool_calls``) and their results (``ToolMessage``) are turns of the
conversation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from ..adapters.chat import ChatTurns
from ..structured import (
    choice_of,
    find_tool_calls,
    render_tools,
    tool_call_constraint,
)
from ..structured import tool_specs as structured_specs
from ..structured.tool_specs import CALL_OPEN
from .messages import _role, _text


def tool_specs(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """Each tool (a LangChain ``BaseTool``, a pydantic class, a TypedDict, a function, a JSON
    schema, an OpenAI tool dict) in OpenAI's function shape (``convert_to_openai_tool``,
    checked by :func:`~tokrag_integrations.structured.tool_spec`).

    Raises:
        TypeError: ``tools`` is not a list, or holds something that is no tool.
        ValueError: two different tools share a name.
    """
    from langchain_core.utils.function_calling import convert_to_openai_tool

    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"bind_tools takes a list of tools, not a {type(tools).__name__}")
    # LangChain's own conversion first: it also reads JSON-schema dicts, TypedDicts and
    # pydantic v1 classes (the structured helpers check the result and the names).
    # The same tool twice (a pydantic class and its JSON schema: titles aside) is one tool.
    unique: dict[str, dict[str, Any]] = {}
    for t in tools:
        spec = convert_to_openai_tool(t)
        if _untitled(spec) not in unique:
            unique[_untitled(spec)] = spec
    return structured_specs(list(unique.values()))


def _untitled(value: Any) -> str:
    """A tool spec without its schema titles (documentation only), as a key."""

    def strip(v: Any) -> Any:
        if isinstance(v, Mapping):
            return {k: strip(x) for k, x in v.items() if not (k == "title" and isinstance(x, str))}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v

    return json.dumps(strip(value), sort_keys=True, default=str)


def checked_tool_choice(tool_choice: Any, specs: list[dict[str, Any]]) -> str:
    """``tool_choice`` as ``"auto"``, ``"none"``, ``"required"`` or a bound tool's name (None:
    ``"auto"``; ``"any"`` / ``True``: ``"required"``; ``False``: ``"none"``; OpenAI's
    ``{"type": "function", "function": {"name": ...}}``).

    Raises:
        ValueError: a name no bound tool has, or a value of none of those kinds.
    """
    return "none" if tool_choice is False else choice_of(tool_choice, specs)


def tool_turn(message: BaseMessage, text: str) -> dict[str, Any] | None:
    """A tool call or a tool result as an OpenAI chat turn (None for other messages):
    an AIMessage with ``tool_calls`` -> ``assistant`` with ``tool_calls``; a ToolMessage ->
    ``tool`` (``tool_call_id``, ``name``, ``content``)."""
    if isinstance(message, ToolMessage):
        return {
            "role": "tool",
            "tool_call_id": message.tool_call_id,
            "name": message.name or "",
            "content": text,
        }
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = [
            {
                "id": c.get("id") or f"call_{i}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["args"])},
            }
            for i, c in enumerate(message.tool_calls)
        ]
        return {"role": "assistant", "content": text, "tool_calls": calls}
    return None


def langchain_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed calls (``id``, ``name``, ``arguments``) as ``AIMessage.tool_calls``."""
    return [
        {"name": c["name"], "args": dict(c["arguments"]), "id": c["id"], "type": "tool_call"}
        for c in calls
    ]


def call_chunks(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Parsed calls as ``AIMessageChunk.tool_call_chunks`` (arguments as JSON text; added
    up they are :func:`langchain_calls`)."""
    return [
        {
            "name": c["name"],
            "args": json.dumps(c["arguments"]),
            "id": c["id"],
            "index": i,
            "type": "tool_call_chunk",
        }
        for i, c in enumerate(calls)
    ]


#: Where a tool call starts in the answer's text (the structured helpers' call format).
CALL_START = CALL_OPEN


def has_tool_turns(messages: Sequence[BaseMessage]) -> bool:
    """Whether the conversation holds a tool call or a tool result."""
    return any(
        isinstance(m, ToolMessage) or (isinstance(m, AIMessage) and m.tool_calls) for m in messages
    )


def plain_messages(
    messages: Sequence[BaseMessage], tools: list[dict[str, Any]], lm: Any
) -> list[BaseMessage]:
    """The conversation with its tool calls and results, and the tools shown to the model
    (:func:`~tokrag_integrations.structured.render_tools` over the model's tokenizer: the
    template's own tools text or one system block; calls and results as text), as system,
    human and AI messages of text.

    Raises:
        ValueError: a message of a kind ChatTokRAG does not take.
    """
    turns = []
    for m in messages:
        text = _text(m)
        turns.append(tool_turn(m, text) or {"role": _role(m), "content": text})
    kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
    return [
        kinds[t["role"]](content=t["content"]) if t["role"] in kinds
        else ChatMessage(role=t["role"], content=t["content"])
        for t in render_tools(lm.tokenizer, turns, tools)
    ]


def remote_tool_turns(messages: Sequence[BaseMessage]) -> ChatTurns:
    """The conversation as OpenAI turns for a ``tokrag serve`` server, which renders the tools
    and the tool turns itself: system messages -> the system prompt; a last human message ->
    the question, the turns before it -> history; a last tool result -> no question (None),
    every turn history.

    Raises:
        ValueError: the conversation ends with neither a human message nor a tool result.
    """
    turns = []
    for m in messages:
        text = _text(m)
        turns.append(tool_turn(m, text) or {"role": _role(m), "content": text})
    system = [t["content"] for t in turns if t["role"] == "system" and t["content"].strip()]
    talk = [t for t in turns if t["role"] != "system"]
    if not talk or talk[-1]["role"] not in ("user", "tool"):
        raise ValueError(
            "The last chat message must be a human message or a tool result: ChatTokRAG "
            "answers it, so end the list with a HumanMessage or a ToolMessage."
        )
    last_user = talk[-1]["role"] == "user"
    return ChatTurns(
        query=talk[-1]["content"] if last_user else None,  # type: ignore[arg-type]
        history=talk[:-1] if last_user else talk,
        system_prompt="\n\n".join(system) or None,
    )


def tool_constraint(tools: list[dict[str, Any]], choice: str, lm: Any, parallel: bool) -> Any:
    """The token constraint of an answer under ``choice`` (None: free text); ``parallel``:
    calls may follow one another (else the answer ends after its first call)."""
    return tool_call_constraint(tools, choice, lm, parallel=parallel)


def parsed_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """(the answer's text without its tool calls, the calls: ``id``, ``name``,
    ``arguments``; the blocks that are no call, as ``AIMessage.invalid_tool_calls``)."""
    content, calls, invalid = find_tool_calls(text)
    bad = [
        {"name": c["name"], "args": c["args"], "id": c["id"], "error": c["error"],
         "type": "invalid_tool_call"}
        for c in invalid
    ]
    return content, calls, bad


class HeldText:
    """A stream's answer text, held back from where a tool call starts (or may be starting),
    so that the token chunks carry the answer's text only; the last chunk carries the rest."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.text = ""
        self.sent = ""

    def push(self, delta: str) -> str:
        """The part of the text so far (with ``delta``) that may be sent now."""
        self.text += delta
        if not self.tools:
            self.sent = self.text
            return delta
        at = self.text.find(CALL_START)
        if at < 0:  # hold a tail that may be the start of CALL_START
            at = len(self.text)
            for n in range(min(len(CALL_START) - 1, len(self.text)), 0, -1):
                if CALL_START.startswith(self.text[-n:]):
                    at = len(self.text) - n
                    break
        out = self.text[len(self.sent):at] if at > len(self.sent) else ""
        self.sent += out
        return out


def unsent(content: str, sent: str) -> str:
    """What the last chunk adds to the ``sent`` text of a stream for the merged text to be the
    answer's ``content`` (the text outside its calls, stripped), outer whitespace of the sent
    part aside."""
    for head in (sent, sent.strip()):
        if content.startswith(head):
            return content[len(head):]
    return content  # pragma: no cover - the sent text is always the content's start
