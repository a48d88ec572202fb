"""LlamaIndex nodes and chat messages as the core's passages and turns."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import MetadataMode, NodeWithScore

from ..adapters.chat import ChatTurns, adapter_passages, split_context, split_turns
from ..prompts import Passage
from ..trace import Trace, by_contribution

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


def _metadata(node: NodeWithScore) -> dict[str, Any]:
    """The node id and metadata; ``source`` (what a citation names) defaults to the
    ``file_path`` / ``file_name`` LlamaIndex's readers set."""
    meta = {"node_id": node.node.node_id, **dict(node.node.metadata or {})}
    src = meta.get("file_path") or meta.get("file_name")
    if "source" not in meta and src is not None:
        meta["source"] = src
    return meta


def node_to_passage(node: NodeWithScore, metadata_mode: Any = MetadataMode.NONE) -> Passage:
    """One node as a core :class:`Passage`: ``node.get_content(metadata_mode=...)``, the
    score, and the node id + metadata as the passage's metadata."""
    return Passage(
        text=node.node.get_content(metadata_mode=metadata_mode),
        score=None if node.score is None else float(node.score),
        metadata=_metadata(node),
    )


def split_node_context(context: str, nodes: Sequence[NodeWithScore]) -> list[Passage] | None:
    """``context`` (a template's ``context_str``: LlamaIndex joins the nodes' texts with blank
    lines) cut by :func:`~tokrag_integrations.adapters.chat.split_context`, each node looked for by its
    text under any metadata mode; a piece keeps its node's score, id and metadata."""
    texts = [[n.node.get_content(metadata_mode=m) for m in MetadataMode] for n in nodes]
    return split_context(context, [node_to_passage(n) for n in nodes], texts, stacklevel=4)


def node_citations(trace: Trace) -> dict[str, list[dict[str, Any]]]:
    """``citations``: the answer's spans (:meth:`Trace.citations_data`; the passage's
    metadata holds its node's ``node_id`` and metadata), ``contributions``: per node, its
    share of the answer's attention (``node_id``, ``share``), largest first. Both empty
    where no token carries a citation (``citations=False``, a policy without a RAG context)."""
    shares: dict[str, float] = {}
    for i, share in trace.contributions():
        node_id = trace.passages[i].metadata.get("node_id")
        if node_id is not None:
            shares[node_id] = shares.get(node_id, 0.0) + share
    ranked = sorted(shares.items(), key=lambda kv: -kv[1])
    return {
        "citations": trace.citations_data(),
        "contributions": [{"node_id": k, "share": v} for k, v in ranked],
    }


def nodes_by_contribution(
    nodes: Sequence[NodeWithScore],
    contributions: Sequence[dict[str, Any]],
    decoded: Collection[str] | None = None,
) -> list[NodeWithScore]:
    """``nodes`` by :func:`~tokrag_integrations.trace.by_contribution` of their ids
    (``contributions``: :func:`node_citations`' list, largest first), those not decoded (not in
    ``decoded``, when given) last."""
    ranked = [c["node_id"] for c in contributions]
    return by_contribution(nodes, ranked, lambda n: n.node.node_id, decoded)


def node_passages(items: Sequence[Any] | None) -> list[Any] | None:
    """``passages=``: nodes (best first: :func:`order_nodes`, when all are nodes), strings,
    :class:`Passage` objects or (text, score) pairs (:func:`~tokrag_integrations.adapters.chat.adapter_passages`)."""
    if items is not None and items and all(isinstance(i, NodeWithScore) for i in items):
        items = order_nodes(items)
    return adapter_passages(
        items, lambda i: node_to_passage(i) if isinstance(i, NodeWithScore) else i, "nodes"
    )


def messages_to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as role/content dicts (roles mapped onto system/user/assistant)."""
    turns = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        turns.append({"role": _ROLE_MAP.get(role, "user"), "content": m.content or ""})
    return turns


def messages_to_turns(messages: Sequence[ChatMessage]) -> ChatTurns:
    """Chat messages split by :func:`~tokrag_integrations.adapters.chat.split_turns` (roles mapped by
    :func:`messages_to_dicts`).

    Raises:
        ValueError: no messages, or the last message is not a user message.
    """
    return split_turns(
        messages_to_dicts(messages), "TokRAGLLM.chat()", "append a user message to ask something"
    )
