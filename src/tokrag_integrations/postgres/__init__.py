"""Enterprise RAG over Postgres + pgvector (docs/postgres.md).

* :func:`ingest` — files into a pgvector table (LlamaIndex's ``PGVectorStore`` schema, or
  langchain-postgres'), idempotently and one transaction per file (``tokrag ingest``).
* :class:`PostgresKnowledgeBase` — the table as a LlamaIndex or LangChain retriever or plain
  :class:`RetrievedChunk` lists, by vector, full-text or hybrid search with metadata
  filters, sync or async over one shared pool; answers with any decoding policy.
* :func:`answer_from_postgres` — one call for ``tokrag ask --store postgres``.
* :func:`resolve_dsn` — ``--dsn``, ``$TOKRAG_PG_DSN``, or an embedded server (``pgserver``).

Needs the ``postgres`` extra: ``pip install 'tokrag-integrations[postgres]'``. Importing this
package is cheap; the database drivers and frameworks load on first use.
"""

from .connection import ResolvedDatabase, check_connection, resolve_dsn
from .dsn import PostgresConnectionError, PostgresQueryError, PostgresSetupError, mask_dsn
from .embedded import DSN_ENV, default_data_dir, start_embedded
from .ingestion import FileReport, IngestSummary, ParseError, ingest
from .layout import DEFAULT_TABLE, TableLayout, validate_table_name
from .search import (
    FILTER_OPERATORS,
    SEARCH_MODES,
    SearchInputError,
    parse_filter_args,
    to_conditions,
    validate_filter_key,
)
from .store import PostgresAnswer, PostgresKnowledgeBase, RetrievedChunk, answer_from_postgres

__all__ = [
    "DEFAULT_TABLE",
    "DSN_ENV",
    "FILTER_OPERATORS",
    "SEARCH_MODES",
    "FileReport",
    "IngestSummary",
    "ParseError",
    "PostgresAnswer",
    "PostgresConnectionError",
    "PostgresKnowledgeBase",
    "PostgresQueryError",
    "PostgresSetupError",
    "ResolvedDatabase",
    "RetrievedChunk",
    "SearchInputError",
    "TableLayout",
    "answer_from_postgres",
    "check_connection",
    "default_data_dir",
    "ingest",
    "mask_dsn",
    "parse_filter_args",
    "resolve_dsn",
    "start_embedded",
    "to_conditions",
    "validate_filter_key",
    "validate_table_name",
]
