"""Enterprise RAG over Postgres + pgvector.

* :func:`ingest` — files into a pgvector table through LlamaIndex's ``PGVectorStore`` schema,
  idempotently and one transaction per file (``tokrag ingest``).
* :class:`PostgresKnowledgeBase` — the ingested table as a LlamaIndex retriever, a LangChain
  retriever, or plain :class:`RetrievedChunk` lists, by vector, full-text or hybrid search
  (:mod:`.search`) with metadata filter operators, sync or async, over one shared psycopg
  pool (:mod:`.pool`); answers with any decoding policy.
* :func:`answer_from_postgres` — one call for ``tokrag ask --store postgres``.
* :func:`resolve_dsn` — ``--dsn``, ``$TOKRAG_PG_DSN``, or an embedded server from ``pgserver``
  in a per-user data folder (see :mod:`.embedded` for the root-user caveat).

Needs the ``postgres`` extra: ``pip install 'tokrag-integrations[postgres]'``. Importing this
package is cheap; the database drivers and frameworks load on first use.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "ingest": "ingestion",
    "IngestSummary": "ingestion",
    "FileReport": "ingestion",
    "ParseError": "ingestion",
    "TableLayout": "layout",
    "PostgresKnowledgeBase": "store",
    "PostgresAnswer": "store",
    "RetrievedChunk": "store",
    "answer_from_postgres": "store",
    "parse_filter_args": "store",
    "to_conditions": "search",
    "SEARCH_MODES": "search",
    "FILTER_OPERATORS": "search",
    "validate_filter_key": "store",
    "resolve_dsn": "server",
    "mask_dsn": "server",
    "default_data_dir": "server",
    "start_embedded": "server",
    "validate_table_name": "server",
    "check_connection": "server",
    "PostgresConnectionError": "server",
    "PostgresSetupError": "server",
    "SearchInputError": "errors",
    "DEFAULT_TABLE": "server",
    "load_embedder": "embeddings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
