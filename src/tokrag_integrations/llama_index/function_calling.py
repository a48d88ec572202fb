"""TokRAGLLM's tool calling (LlamaIndex's ``FunctionCallingLLM`` contract), as translation:
LlamaIndex tools and chat messages become the OpenAI-shaped tool specs and turns that
:mod:`tokrag_integrations.structured` renders with the model's chat template and constrains
(``tool_call_constraint``); the model's ``<tool_call>`` text comes back as ``ToolCallBlock``
blocks and ``ToolSelection``s.

Tool results are retrieved text: a turn that answers tool results (``role="tool"`` messages
after the assistant's call) decodes under the LLM's ``policy`` (Tok-RAG by default) with the
last tool result as the RAG context's retrieved span and, as the pure context, the question
and the conversation before it without the tools.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection

from ..adapters.chat import split_turns
from ..models import LoadedModel
from ..prompts import Passage, RenderedPrompt
from ..structured import (
    choice_of,
    parse_tool_calls,
    render_tools,
    tool_call_constraint,
    tool_specs,
)
from ..structured.tool_specs import CALL_OPEN
from .llm_responses import as_chat
from .nodes import messages_to_dicts

#: What starts a tool call in the model's answer (the Hermes / Qwen convention that
#: :mod:`tokrag_integrations.structured` renders, constrains and parses).
TOOL_CALL_START = CALL_OPEN


def _role(m: ChatMessage) -> str:
    return m.role.value if hasattr(m.role, "value") else str(m.role)


def specs_of(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """``tools`` (LlamaIndex tools, their ``ToolMetadata``, OpenAI tool dicts, pydantic
    classes or functions) as OpenAI tool specs (:func:`structured.tool_specs`)."""
    return tool_specs(list(tools))


def prepare(
    tools: Sequence[Any],
    user_msg: str | ChatMessage | None,
    chat_history: list[ChatMessage] | None,
    tool_required: bool,
    tool_choice: Any,
    kwargs: dict[str, Any],
    allow_parallel_tool_calls: bool = False,
) -> dict[str, Any]:
    """``FunctionCallingLLM._prepare_chat_with_tools``: the chat arguments (the history is
    copied, never extended in place)."""
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    if tool_choice is None and tool_required:
        tool_choice = "required"
    specs = specs_of(tools)
    return {
        "messages": messages,
        "tools": specs,
        "tool_choice": choice_of(tool_choice, specs),
        "parallel_tool_calls": allow_parallel_tool_calls,
        **kwargs,
    }


def _calls_of(m: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's tool calls (its ``ToolCallBlock``s, else OpenAI-shaped
    ``additional_kwargs["tool_calls"]``) as ``{"id", "name", "arguments"}``."""
    calls = [
        {"id": b.tool_call_id or "", "name": b.tool_name, "arguments": b.tool_kwargs}
        for b in m.blocks
        if isinstance(b, ToolCallBlock)
    ]
    for c in m.additional_kwargs.get("tool_calls") or [] if not calls else []:
        c = c if isinstance(c, dict) else c.model_dump()
        fn = c.get("function") or c
        calls.append(
            {"id": c.get("id") or "", "name": fn["name"], "arguments": fn.get("arguments")}
        )
    for c in calls:
        if isinstance(c["arguments"], str):
            try:
                c["arguments"] = json.loads(c["arguments"] or "{}")
            except ValueError:
                pass  # the template shows it as written
    return calls


def openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as OpenAI-shaped turns: assistant tool calls under ``tool_calls``
    (arguments as dicts), tool results as ``role: "tool"`` with ``tool_call_id`` and the
    called tool's ``name``."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for m in messages:
        role = _role(m)
        if role in ("tool", "function"):
            call_id = str(m.additional_kwargs.get("tool_call_id") or "")
            name = m.additional_kwargs.get("name") or names.get(call_id, "")
            out.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": m.content or ""}
            )
            continue
        turn: dict[str, Any] = messages_to_dicts([m])[0]
        calls = _calls_of(m) if role == "assistant" else []
        if calls:
            names.update({c["id"]: c["name"] for c in calls})
            turn["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
        out.append(turn)
    return out


def tool_rounds(messages: Sequence[ChatMessage]) -> int:
    """How many assistant messages with tool calls follow the last user message."""
    n = 0
    for m in reversed(messages):
        if _role(m) == "user":
            break
        n += _role(m) == "assistant" and bool(_calls_of(m))
    return n


def _tool_results(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The tool results that end the conversation (after its last assistant message)."""
    tail: list[ChatMessage] = []
    for m in reversed(messages):
        if _role(m) not in ("tool", "function"):
            break
        tail.insert(0, m)
    return tail


def tool_turn(
    lm: Any,
    messages: Sequence[ChatMessage],
    specs: list[dict[str, Any]],
    choice: str,
    gen_kw: dict[str, Any],
    *,
    policy: str,
    passages: Any,
    parallel: bool = True,
) -> tuple[str, dict[str, Any]]:
    """(the question, the core's keyword arguments) of a chat turn offered ``specs``: the
    turns rendered with the tools, the answer constrained by ``tool_call_constraint`` (unless
    the call gives its own ``constraint``); after tool results, the last one is the retrieved
    text of ``policy``'s RAG context (module docstring). Without ``parallel`` calls the
    constraint ends the answer with its first call."""
    results = _tool_results(messages)
    if not isinstance(lm, LoadedModel):
        if results and passages is None:
            gen_kw["policy"] = policy  # the server finds the results in the turns
        return _remote_turn(messages, specs, choice, gen_kw, parallel)
    turns = render_tools(lm.tokenizer, openai_messages(messages), specs)
    if choice != "none" and "constraint" not in gen_kw:
        constraint = tool_call_constraint(specs, choice, lm, parallel=parallel)
        if constraint is not None:
            gen_kw["constraint"] = constraint
    context = (results[-1].content or "") if results else ""
    if (
        results
        and passages is None
        and context.strip()
        and any(context in t["content"] for t in turns)
    ):
        plain = [m for m in messages if _role(m) in ("system", "developer", "user", "assistant")]
        plain = [m for m in plain if not _calls_of(m)]
        asked = split_turns(
            messages_to_dicts(plain), "TokRAGLLM.chat()", "ask before the tools answer"
        )
        call_id = str(results[-1].additional_kwargs.get("tool_call_id") or "")
        source = {"source": "tool result", "tool_call_id": call_id}
        gen_kw["policy"] = policy
        gen_kw["rendered"] = RenderedPrompt(
            context, messages=turns, passages=[Passage(context, metadata=source)]
        )
        if asked.history:
            gen_kw["messages"] = asked.history
        if asked.system_prompt is not None:
            gen_kw["system_prompt"] = asked.system_prompt
        return asked.query, gen_kw
    split = split_turns(turns, "TokRAGLLM.chat()", "append a user message or tool results")
    if split.history:
        gen_kw["messages"] = split.history
    if split.system_prompt is not None:
        gen_kw["system_prompt"] = split.system_prompt
    if passages is None:
        gen_kw["prompt_format"] = "chat"
    return split.query, gen_kw


def _remote_turn(
    messages: Sequence[ChatMessage],
    specs: list[dict[str, Any]],
    choice: str,
    gen_kw: dict[str, Any],
    parallel: bool,
) -> tuple[str | None, dict[str, Any]]:
    """A tool turn for a ``tokrag serve`` server (``base_url=``): the OpenAI-shaped turns,
    tools, choice and ``parallel_tool_calls`` travel, the server renders and constrains (the question is None when
    the conversation ends with tool results)."""
    turns = openai_messages(messages)
    query = None
    if turns and turns[-1]["role"] == "user":
        query = turns.pop()["content"]
    gen_kw.update(
        messages=turns, tools=specs, tool_choice=choice, parallel_tool_calls=parallel
    )
    return query, gen_kw


def tool_message(text: str) -> ChatMessage:
    """The assistant's message of an answer offered tools: its text outside the calls as a
    ``TextBlock``, each call as a ``ToolCallBlock`` (and OpenAI-shaped in
    ``additional_kwargs["tool_calls"]``)."""
    content, calls = parse_tool_calls(text)
    blocks: list[Any] = [TextBlock(text=content)] if content else []
    blocks += [
        ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"])
        for c in calls
    ]
    kwargs = {}
    if calls:
        kwargs["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=kwargs)


def chat_response(c: CompletionResponse, tools: list[dict[str, Any]] | None) -> ChatResponse:
    """``c`` as a chat response, its text parsed for tool calls when tools were offered."""
    return as_chat(c, tool_message(c.text) if tools else None)


def _visible(text: str) -> str:
    """``text`` up to where a tool call starts (or may be starting)."""
    at = text.find(TOOL_CALL_START)
    if at >= 0:
        return text[:at]
    for k in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:k]):
            return text[:-k]
    return text


class _Shown:
    """The streamed chat responses of an answer offered tools: text deltas up to a tool
    call (the call's own text is not streamed), the last response parsed for calls."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools, self.shown = tools, ""

    def __call__(self, c: CompletionResponse) -> ChatResponse | None:
        if c.delta == "" or not self.tools:  # the last response (or no tools): as it is
            return chat_response(c, self.tools) if c.delta == "" else as_chat(c)
        visible = _visible(c.text)
        if len(visible) <= len(self.shown):
            return None
        delta, self.shown = visible[len(self.shown) :], visible
        r = as_chat(c, ChatMessage(role=MessageRole.ASSISTANT, content=visible))
        r.delta = delta
        return r


def chat_stream(
    gen: Iterator[CompletionResponse], tools: list[dict[str, Any]] | None
) -> Iterator[ChatResponse]:
    """A completion stream as chat responses (:class:`_Shown`)."""
    shown = _Shown(tools)
    for c in gen:
        r = shown(c)
        if r is not None:
            yield r


async def achat_stream(
    gen: AsyncIterator[CompletionResponse], tools: list[dict[str, Any]] | None
) -> AsyncIterator[ChatResponse]:
    """Async :func:`chat_stream`."""
    shown = _Shown(tools)
    async for c in gen:
        r = shown(c)
        if r is not None:
            yield r


def keep_first_call(response: ChatResponse) -> None:
    """Drop every tool call of ``response`` after the first (``allow_parallel_tool_calls``
    off)."""
    m = response.message
    calls = [b for b in m.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) > 1:
        m.blocks = [b for b in m.blocks if not isinstance(b, ToolCallBlock) or b is calls[0]]
        if m.additional_kwargs.get("tool_calls"):
            m.additional_kwargs["tool_calls"] = m.additional_kwargs["tool_calls"][:1]


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The ``ToolCallBlock``s of ``response`` as ``ToolSelection``s; none is a ValueError
    under ``error_on_no_tool_call``."""
    calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    if not calls and error_on_no_tool_call:
        raise ValueError(
            "The model answered without calling a tool: pass tool_required=True (or "
            "tool_choice='required' / a tool's name) to make it call one."
        )
    return [
        ToolSelection(
            tool_id=b.tool_call_id or "",
            tool_name=b.tool_name,
            tool_kwargs=b.tool_kwargs if isinstance(b.tool_kwargs, dict) else {},
        )
        for b in calls
    ]


class ToolCalling:
    """LlamaIndex's ``FunctionCallingLLM`` contract over a ``chat`` that takes ``tools=`` and
    ``tool_choice=`` (a mixin of ``TokRAGLLM``)."""

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments offering ``tools``: ``tool_choice`` ("auto", "required",
        "none" or a tool's name) or, when None, "required" under ``tool_required`` and "auto"
        otherwise."""
        return prepare(
            tools,
            user_msg,
            chat_history,
            tool_required,
            tool_choice,
            kwargs,
            allow_parallel_tool_calls,
        )

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[Any],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Only the first tool call unless ``allow_parallel_tool_calls``."""
        if not allow_parallel_tool_calls:
            keep_first_call(response)
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls of a ``chat_with_tools`` response, as ``ToolSelection``s."""
        return tool_selections(response, error_on_no_tool_call)
