"""LangChain messages and documents as the core API's arguments, results as response metadata."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata

from ..adapters.chat import ChatTurns, adapter_passages, split_context, split_turns
from ..adapters.translate import FINISH_REASONS, usage
from ..models import LoadedModel
from ..prompts import Passage, RenderedPrompt
from ..results import GenerationResult


def to_passage(item: Any) -> Any:
    """A LangChain ``Document`` as a :class:`Passage` (``page_content``, ``metadata["score"]``,
    ``metadata`` with the document's ``id`` when it has one: citations name it); anything
    else is left to the core."""
    if isinstance(item, Document):
        score = item.metadata.get("score")
        metadata = dict(item.metadata)
        if item.id is not None:
            metadata.setdefault("id", item.id)
        return Passage(
            text=item.page_content or "",
            score=float(score) if isinstance(score, (int, float)) else None,
            metadata=metadata,
        )
    return item


def document_passages(items: Sequence[Any] | None) -> list[Any]:
    """``passages=``: Documents (:func:`to_passage`), strings, Passage objects or (text, score)
    pairs (:func:`~tokrag_integrations.adapters.chat.adapter_passages`; ``None`` -> ``[]``)."""
    return adapter_passages(items, to_passage, "Documents") or []


def _text(message: BaseMessage) -> str:
    """The text of a message; non-text content (images, audio, files) is refused."""
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(message, AIMessage):
            continue  # reasoning / tool-call blocks of earlier answers carry no prompt text
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(
                f"ChatTokRAG reads text only, but a {message.type} message holds a {kind!r} "
                "content block. Pass the text of the message instead."
            )
    return "".join(parts)


def _role(message: BaseMessage) -> str:
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, ChatMessage):
        return {"human": "user", "ai": "assistant"}.get(message.role, message.role)
    raise ValueError(
        f"ChatTokRAG cannot take a {type(message).__name__} here; pass system, human and AI "
        "messages, and tool calls with their ToolMessage results."
    )


def messages_to_prompt(messages: Sequence[BaseMessage]) -> ChatTurns:
    """LangChain messages split by :func:`~tokrag_integrations.adapters.chat.split_turns`: system
    messages -> ``system_prompt``; the last human turns, joined -> the query; the rest ->
    history.

    Raises:
        ValueError: no messages, or the conversation does not end with a human message.
    """
    turns = [{"role": _role(m), "content": _text(m)} for m in messages]
    return split_turns(turns, "ChatTokRAG", "end the list with a HumanMessage")


def rendered_prompt(
    messages: Sequence[BaseMessage],
    context: str,
    question: str | None = None,
    passages: list[Any] | None = None,
) -> tuple[RenderedPrompt, ChatTurns]:
    """Messages formatted by the caller's template, whose context variable received
    ``context`` (holding ``passages``) -> (the RAG context: every message as formatted; the
    pure context: the question, else the last human turn without ``context``, after the turns
    and under the system messages that do not hold ``context``).

    Raises:
        TypeError: ``context`` or ``question`` is not a string.
        ValueError: as :func:`messages_to_prompt`.
    """
    if not isinstance(context, str):
        raise TypeError(
            f"context must be the formatted context string, not {type(context).__name__}"
        )
    if question is not None and not isinstance(question, str):
        raise TypeError(f"question must be a string, not {type(question).__name__}")
    prompt = messages_to_prompt(messages)  # validates the conversation
    turns = [{"role": _role(m), "content": _text(m)} for m in messages]
    rendered = RenderedPrompt(
        context, messages=turns, passages=split_context(context, passages or [], stacklevel=4)
    )

    def holds(text: str) -> bool:
        return bool(context) and context in text

    system = [t["content"] for t in turns if t["role"] == "system" and t["content"].strip()]
    query = question
    if query is None:
        query = prompt.query.replace(context, " ").strip() if context else prompt.query
    if not query.strip():
        raise ValueError(
            "The question for the pure context is empty (the last human message holds only "
            "the context): pass question=... with context=."
        )
    return rendered, ChatTurns(
        query=query,
        history=[t for t in prompt.history if not holds(t["content"])],
        system_prompt="\n\n".join(t for t in system if not holds(t)) or None,
    )


def usage_metadata(result: GenerationResult) -> UsageMetadata:
    """Input tokens: every context the policy prefilled; output tokens: one per step."""
    u = usage(result)
    return UsageMetadata(
        input_tokens=u["prompt_tokens"],
        output_tokens=u["completion_tokens"],
        total_tokens=u["total_tokens"],
    )


def final_metadata(result: GenerationResult, lm: LoadedModel) -> dict[str, Any]:
    """Response metadata of a whole answer, except the per-token lists."""
    trace = result.trace
    data = trace.to_dict()
    return {
        "model_name": lm.name,
        "model_provider": "tokrag",
        "finish_reason": FINISH_REASONS.get(result.stop_reason, result.stop_reason),
        "stop_reason": result.stop_reason,
        "policy": trace.policy,
        "counts": trace.counts(),
        "prompt_tokens": dict(trace.prompt_tokens),
        "warnings": list(trace.warnings),
        "trace": data,
        "citations": trace.citations_data(),
    }


def token_metadata(sources: list[str], token_ids: list[int]) -> dict[str, Any]:
    # Lists, so that the chunks of a stream add up to invoke()'s metadata.
    return {"token_sources": sources, "token_ids": token_ids}
