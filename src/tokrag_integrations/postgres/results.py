"""What a search of the ingested table returns: :class:`RetrievedChunk` rows and the
:class:`PostgresAnswer` of :func:`~.store.answer_from_postgres`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

__all__ = ["PATH_KEYS", "PostgresAnswer", "RetrievedChunk", "relative_source"]

#: Metadata keys holding a file's path on the machine that ingested it: ``source`` (tokrag's
#: ingest, the resolved absolute path) and ``file_path`` (LlamaIndex's readers).
PATH_KEYS = ("source", "file_path")

# LlamaIndex's bookkeeping keys, dropped from the metadata we hand to prompts and users.
_INTERNAL_KEYS = frozenset({"_node_content", "_node_type", "doc_id", "document_id", "ref_doc_id"})


@dataclass
class RetrievedChunk:
    """One retrieved chunk with its score (higher is better): the cosine similarity for
    ``search="vector"``, the full-text tier plus ``ts_rank / (1 + ts_rank)`` for ``"text"``,
    the reciprocal rank fusion score for ``"hybrid"``."""

    text: str
    score: float
    source: str
    chunk: int
    metadata: dict[str, Any] = field(default_factory=dict)
    node_id: str = ""

    def to_passage(self) -> Any:
        """As a core :class:`~tokrag_integrations.Passage`."""
        from ..prompts import Passage

        return Passage(self.text, score=self.score, metadata=dict(self.metadata))


@dataclass
class PostgresAnswer:
    """What :func:`answer_from_postgres` returns; unpacks as ``result, chunks``."""

    result: Any
    """The :class:`~tokrag_integrations.GenerationResult` (text, trace, provenance)."""
    chunks: list[RetrievedChunk]
    """The chunks given to the model, best first."""

    def __iter__(self) -> Any:
        return iter((self.result, self.chunks))


def relative_source(source: str, root: str | PurePath) -> str:
    """``source`` relative to the folder ``root`` (``/srv/docs/hr/leave.md`` under
    ``/srv/docs``: ``hr/leave.md``), or its last component alone when it is not under
    ``root``; for clients that should not learn the server's folders. ``root`` is taken as
    written: give it as absolute and resolved, as ingest stores sources."""
    path = PurePath(os.path.normpath(source))  # "docs/../etc" is not under "docs"
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _clean_metadata(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (meta or {}).items() if k not in _INTERNAL_KEYS}


def _chunk(node_id: str, text: str, meta: Any, score: Any) -> RetrievedChunk:
    if isinstance(meta, str):  # a json column read as text
        meta = json.loads(meta)
    meta = meta if isinstance(meta, dict) else {}
    source = meta.get("source") or meta.get("ref_doc_id") or ""
    clean = _clean_metadata(meta)
    try:
        chunk = int(clean.get("chunk", 0))
    except (TypeError, ValueError):
        chunk = 0
    return RetrievedChunk(
        text=text or "",
        score=float(score),
        source=str(source),
        chunk=chunk,
        metadata=clean,
        node_id=str(node_id or ""),
    )
