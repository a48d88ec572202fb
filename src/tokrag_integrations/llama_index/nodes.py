"""LlamaIndex nodes and chat messages as the core's passages and turns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import MetadataMode, NodeWithScore

from ..prompts import Passage

#: LlamaIndex chat roles mapped onto the three roles a chat template knows.
_ROLE_MAP = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "chatbot": "assistant",
    "model": "assistant",
    "tool": "user",
    "function": "user",
}


def order_nodes(nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """Nodes best first (the core drops the last first): by score (descending, stable) when
    every node has one, else as given."""
    nodes = list(nodes)
    if nodes and all(n.score is not None for n in nodes):
        return sorted(nodes, key=lambda n: -float(n.score))  # type: ignore[arg-type]
    return nodes


def node_to_passage(node: NodeWithScore, metadata_mode: Any = MetadataMode.NONE) -> Passage:
    """One node as a core :class:`Passage`: ``node.get_content(metadata_mode=...)``, the
    score, and the node id + metadata as the passage's metadata."""
    return Passage(
        text=node.node.get_content(metadata_mode=metadata_mode),
        score=None if node.score is None else float(node.score),
        metadata={"node_id": node.node.node_id, **dict(node.node.metadata or {})},
    )


def to_passages(items: Sequence[Any] | None) -> list[Any] | None:
    """Accept nodes, strings, :class:`Passage` objects or (text, score) pairs for ``passages=``."""
    if items is None:
        return None
    items = list(items)
    if items and all(isinstance(i, NodeWithScore) for i in items):
        return [node_to_passage(n) for n in order_nodes(items)]
    return [node_to_passage(i) if isinstance(i, NodeWithScore) else i for i in items]


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as role/content dicts (roles mapped onto system/user/assistant)."""
    turns = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        turns.append({"role": _ROLE_MAP.get(role, "user"), "content": m.content or ""})
    return turns


def messages_to_turns(messages: Sequence[ChatMessage]) -> tuple[list[dict[str, str]], str]:
    """Split chat messages into earlier turns (role/content dicts) and the final user question.

    Raises:
        ValueError: no messages, or the last message is not a user message.
    """
    if not messages:
        raise ValueError("chat() got no messages: pass at least one user message.")
    turns = messages_to_dicts(messages)
    last = turns[-1]
    if last["role"] != "user":
        raise ValueError(
            f"The last chat message must be the user's question; got a {last['role']!r} message. "
            "Append a user message to ask something."
        )
    return turns[:-1], last["content"]
