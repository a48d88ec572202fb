"""LlamaIndex nodes and chat messages as the core's passages and turns."""

from __future__ import annotations

import warnings
from collections.abc import Collection, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import MetadataMode, NodeWithScore

from ..prompts import Passage
from ..trace import Trace

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


def split_context(context: str, nodes: Sequence[NodeWithScore]) -> list[Passage] | None:
    """``context`` (a template's ``context_str``: LlamaIndex joins the nodes' texts with blank
    lines) cut into one passage per node found in it (its text under any metadata mode, outer
    whitespace aside; the longest found), each running to the next. Text outside the nodes
    that is not whitespace is a passage of its own without a node id, with a warning naming
    the nodes not found. Joined, the passages give ``context``; None when no node is in it."""
    found: list[tuple[int, int, NodeWithScore]] = []
    for n in nodes:
        texts = {n.node.get_content(metadata_mode=m).strip() for m in MetadataMode} - {""}
        for t in sorted(texts, key=len, reverse=True):
            at = context.find(t)
            while at >= 0 and any(a < at + len(t) and at < b for a, b, _ in found):
                at = context.find(t, at + 1)
            if at >= 0:
                found.append((at, at + len(t), n))
                break
    starts: list[tuple[int, NodeWithScore | None]] = []
    pos = 0
    for at, end, n in sorted(found, key=lambda f: f[0]):
        if context[pos:at].strip():
            starts.append((pos, None))
        starts.append((at if starts else 0, n))
        pos = end
    if context[pos:].strip():
        starts.append((pos, None))
    if any(n is None for _, n in starts) or (context.strip() and not found):
        held = {id(n) for _, _, n in found}
        missing = [n.node.node_id for n in nodes if id(n) not in held]
        warnings.warn(
            "Part of the template's context is not the text of any node given to the "
            f"synthesizer (not found: {', '.join(missing) or 'none'}): citations to that part "
            "name no node.",
            stacklevel=4,
        )
    if not found:
        return None
    out = []
    for (at, n), (end, _) in zip(starts, [*starts[1:], (len(context), None)], strict=True):
        if n is None:
            out.append(Passage(context[at:end], metadata={"source": "template context"}))
        else:
            score = None if n.score is None else float(n.score)
            out.append(Passage(context[at:end], score, _metadata(n)))
    return out


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


def by_contribution(
    nodes: Sequence[NodeWithScore],
    contributions: Sequence[dict[str, Any]],
    decoded: Collection[str] | None = None,
) -> list[NodeWithScore]:
    """``nodes`` the answer drew on first, largest contribution first; then the others in
    their order, those not decoded (not in ``decoded``, when given) last. As given without
    contributions."""
    rank = {c["node_id"]: k for k, c in enumerate(contributions)}
    if not rank:
        return list(nodes)

    def key(n: NodeWithScore) -> tuple[int, int]:
        node_id = n.node.node_id
        if node_id in rank:
            return 0, rank[node_id]
        return (1 if decoded is None or node_id in decoded else 2), 0

    return sorted(nodes, key=key)


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
