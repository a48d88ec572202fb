"""Type translation between LlamaIndex and the core (nodes, chat messages, metadata)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.schema import MetadataMode, NodeWithScore

from ..policies import get_policy
from ..prompts import Passage
from ..results import GenerationResult

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


def node_to_passage(node: NodeWithScore, metadata_mode: Any = MetadataMode.NONE) -> Passage:
    """One node as a core :class:`Passage`: ``node.get_content(metadata_mode=...)`` (the
    node's text alone by default; the synthesizer passes its ``metadata_mode``), the score,
    and the node id + metadata as the passage's metadata."""
    return Passage(
        text=node.node.get_content(metadata_mode=metadata_mode),
        score=None if node.score is None else float(node.score),
        metadata={"node_id": node.node.node_id, **dict(node.node.metadata or {})},
    )


def nodes_to_passages(
    nodes: Sequence[NodeWithScore], metadata_mode: Any = MetadataMode.NONE
) -> tuple[list[NodeWithScore], list[Passage]]:
    """(nodes in the order given to the core, their passages)."""
    ordered = order_nodes(nodes)
    return ordered, [node_to_passage(n, metadata_mode) for n in ordered]


def to_passages(items: Sequence[Any] | None) -> list[Any] | None:
    """Accept nodes, strings, :class:`Passage` objects or (text, score) pairs for ``passages=``."""
    if items is None:
        return None
    items = list(items)
    if items and all(isinstance(i, NodeWithScore) for i in items):
        return nodes_to_passages(items)[1]
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
        "n_nodes_dropped": len(dropped),
        "nodes_skipped_empty": empty,
        "warnings": list(tr.warnings),
        "trace": tr.to_dict(),
    }


def usage(result: GenerationResult, roles: Sequence[str] | None = None) -> dict[str, Any]:
    """Token usage of one decode, in the keys LlamaIndex's ``TokenCountingHandler`` reads.

    ``prompt_tokens`` counts every context the policy prefilled (``tokrag`` and the other
    two-context rules prefill the pure and the RAG prompt, so both count; ``rag`` only the
    RAG prompt, ``llm`` only the pure one; the same rule as ``ChatTokRAG``'s usage), per
    context in ``prompt_tokens_by_context``; ``completion_tokens`` is one per decoding step.
    ``roles`` are the policy's context roles (looked up by the trace's policy name if None).
    """
    tr = result.trace
    prompt = {k: int(v or 0) for k, v in tr.prompt_tokens.items()}
    if roles is None:
        try:
            roles = get_policy(tr.policy).roles
        except (KeyError, ValueError, TypeError):
            roles = ()
    roles = set(roles) & {"pure", "rag"}
    if not roles:  # per-passage rules (rag_token, rag_sequence): the RAG prompt stands in
        roles = {"rag"}
    if not prompt.get("rag"):  # no usable passage: answered from the pure context alone
        roles = {"pure"}
    n_in = sum(prompt.get(r, 0) for r in roles)
    n_out = len(tr.steps)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_by_context": prompt,
    }


def call_summary(
    index: int,
    kind: str,
    result: GenerationResult,
    sources: Sequence[dict[str, Any]],
    *,
    level: int | None = None,
    roles: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One entry of ``Response.metadata["calls"]``: what one model call was given and did.

    Args:
        index: the call's position in the synthesis.
        kind: ``"answer"`` (first call over nodes), ``"refine"`` (nodes plus the answer so
            far), ``"summarize"`` (a tree leaf over nodes) or ``"combine"`` (a tree level
            over earlier answers).
        result: the core's result.
        sources: per passage given to the core, in order: ``{"node_id": ..., "part": ...}``
            for (a part of) a node, ``{"answer_of": call index}`` for an earlier answer.
        level: the tree level (tree_summarize only).
        roles: the policy's context roles (for :func:`usage`).
    """
    tr = result.trace
    used, cut, dropped = [], [], []
    for rec in tr.passages:
        src = sources[rec.rank] if rec.rank < len(sources) else {}
        nid = src.get("node_id")
        if nid is None or not rec.text.strip():
            continue
        if rec.kept:
            used.append(nid)
            if rec.cut:
                cut.append(nid)
        else:
            dropped.append(nid)
    entry: dict[str, Any] = {
        "index": index,
        "kind": kind,
        "node_ids": [s["node_id"] for s in sources if "node_id" in s],
        "answers_from": [s["answer_of"] for s in sources if "answer_of" in s],
        "text": result.text,
        "counts": result.counts,
        "stop_reason": tr.stop_reason,
        "usage": usage(result, roles),
        "nodes_used": used,
        "nodes_cut": cut,
        "nodes_dropped": dropped,
        "warnings": list(tr.warnings),
        "trace": tr.to_dict(),
    }
    if level is not None:
        entry["level"] = level
    return entry
