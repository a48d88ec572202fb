"""Enterprise RAG over Postgres + pgvector (docs/postgres.md): :func:`ingest` files into a
table, read it with :class:`PostgresKnowledgeBase` (vector, text or hybrid search, both
frameworks' retrievers) or :func:`answer_from_postgres`; :func:`resolve_dsn` finds the
database (``--dsn``, ``$TOKRAG_PG_DSN`` or the embedded server). Needs the ``postgres`` extra;
the drivers and frameworks load on first use.
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
    "resolve_dsn",
    "start_embedded",
    "to_conditions",
    "validate_filter_key",
    "validate_table_name",
]
