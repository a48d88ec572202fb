"""Type translation between LlamaIndex and the core (nodes, chat messages, metadata)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import NodeWithScore

from ..api import GenerationResult
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
    """Nodes best first: by score (descending, stable) when every node has one, else as given.

    The core drops passages from the lowest-ranked (last) up when the window is full, so this
    order makes it drop the lowest-scored node first.
    """
    nodes = list(nodes)
    if nodes and all(n.score is not None for n in nodes):
        return sorted(nodes, key=lambda n: -float(n.score))  # type: ignore[arg-type]
    return nodes


def node_to_passage(node: NodeWithScore) -> Passage:
    """One node as a core :class:`Passage` (text without metadata, score, node id + metadata)."""
    return Passage(
        text=node.node.get_content(),
        score=None if node.score is None else float(node.score),
        metadata={"node_id": node.node.node_id, **dict(node.node.metadata or {})},
    )


def nodes_to_passages(nodes: Sequence[NodeWithScore]) -> tuple[list[NodeWithScore], list[Passage]]:
    """(nodes in the order given to the core, their passages)."""
    ordered = order_nodes(nodes)
    return ordered, [node_to_passage(n) for n in ordered]


def to_passages(items: Sequence[Any] | None) -> list[Any] | None:
    """Accept nodes, strings, :class:`Passage` objects or (text, score) pairs for ``passages=``."""
    if items is None:
        return None
    items = list(items)
    if items and all(isinstance(i, NodeWithScore) for i in items):
        return nodes_to_passages(items)[1]
    return [node_to_passage(i) if isinstance(i, NodeWithScore) else i for i in items]


def messages_to_turns(messages: Sequence[ChatMessage]) -> tuple[list[dict[str, str]], str]:
    """Split chat messages into earlier turns (role/content dicts) and the final user question.

    Raises:
        ValueError: no messages, or the last message is not a user message.
    """
    if not messages:
        raise ValueError("chat() got no messages: pass at least one user message.")
    turns = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        turns.append({"role": _ROLE_MAP.get(role, "user"), "content": m.content or ""})
    last = turns[-1]
    if last["role"] != "user":
        raise ValueError(
            f"The last chat message must be the user's question; got a {last['role']!r} message. "
            "Append a user message to ask something."
        )
    return turns[:-1], last["content"]


def jsonable(obj: Any) -> Any:
    """A JSON-safe deep copy (tensors/numpy scalars to numbers, unknown objects to str), for
    data other than a trace (a gate's decision); ``Trace.to_dict()`` is JSON data already."""

    def default(o: Any) -> Any:
        if hasattr(o, "tolist"):
            return o.tolist()
        if hasattr(o, "item"):
            return o.item()
        if isinstance(o, (set, tuple)):
            return list(o)
        return str(o)

    return json.loads(json.dumps(obj, default=default, ensure_ascii=False))


def result_kwargs(result: GenerationResult) -> dict[str, Any]:
    """Provenance summary for ``CompletionResponse.additional_kwargs``."""
    tr = result.trace
    return {
        "policy": tr.policy,
        "counts": result.counts,
        "stop_reason": tr.stop_reason,
        "warnings": list(tr.warnings),
        "model": tr.model,
    }


def response_metadata(
    result: GenerationResult,
    nodes: Sequence[NodeWithScore],
    *,
    policy: str,
    gate: dict[str, Any] | None,
    pure_reason: str | None,
) -> dict[str, Any]:
    """``Response.metadata`` for a synthesised answer.

    Args:
        result: the core's result.
        nodes: the nodes in the order their passages were given to the core (rank order).
        policy: the requested policy name.
        gate: the gate decision as a dict (None without a gate).
        pure_reason: why no passage was given to the core (None when passages were given).
    """
    tr = result.trace
    node_ids = [n.node.node_id for n in nodes]
    records = []
    used, dropped, cut, empty = [], [], [], []
    for rec in tr.passages:
        nid = rec.metadata.get("node_id", node_ids[rec.rank] if rec.rank < len(node_ids) else None)
        is_empty = not rec.text.strip()
        records.append(
            {
                "node_id": nid,
                "rank": rec.rank,
                "score": rec.score,
                "kept": rec.kept,
                "cut": rec.cut,
                "empty": is_empty,
                "n_tokens": rec.n_tokens,
            }
        )
        if rec.kept:
            used.append(nid)
            if rec.cut:
                cut.append(nid)
        elif is_empty:
            empty.append(nid)
        else:
            dropped.append(nid)
    if pure_reason is None and not used:
        pure_reason = "no node had usable text" if nodes else "no nodes were retrieved"
    if pure_reason is None and policy == "llm":
        pure_reason = "policy 'llm' ignores retrieval"
    return {
        "policy": policy,
        "policy_used": "llm" if pure_reason else policy,
        "answered_from": "pure_context" if pure_reason else "retrieval",
        "pure_context_reason": pure_reason,
        "counts": result.counts,
        "model": tr.model,
        "stop_reason": tr.stop_reason,
        "gate": gate,
        "passages": records,
        "nodes_used": used,
        "nodes_cut": cut,
        "nodes_dropped": dropped,
        "nodes_skipped_empty": empty,
        "warnings": list(tr.warnings),
        "trace": tr.to_dict(),
    }
