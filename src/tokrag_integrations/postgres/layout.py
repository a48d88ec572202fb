"""The table layouts tokrag writes and reads, and the check that a table of that name is one.

Written and read: LlamaIndex's ``PGVectorStore`` schema (``data_<name>``, also as made by
``PGVectorStore(hybrid_search=True)``) and ``langchain-postgres``' ``PGEngine`` default
columns. Read only: a collection of the older langchain-postgres ``PGVector``
(``langchain_pg_embedding`` rows of one ``langchain_pg_collection``).

Each layout may carry a full-text column (:data:`~.search.TSV_COLUMN`, a generated
``tsvector`` with a GIN index): :func:`text_search_column` finds it and its text search
configuration, :func:`add_text_search` adds it to a table that lacks it.

Shared by :mod:`.ingestion` (which writes the tables) and :mod:`.store` (which reads them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from .server import PostgresQueryError, is_reserved_word, validate_table_name

__all__ = [
    "Target",
    "TableLayout",
    "add_text_search",
    "check_layout",
    "detect_layout",
    "legacy_collection",
    "table_columns",
    "text_search_column",
]

Target = Literal["llamaindex", "langchain"]


@dataclass(frozen=True)
class TableLayout:
    """Physical table and column names of one of the two supported layouts."""

    target: str
    """``"llamaindex"``, ``"langchain"`` or ``"langchain_legacy"`` (read only)."""
    table: str
    """Physical table name (``data_<name>`` for LlamaIndex)."""
    id_column: str
    text_column: str
    metadata_column: str
    embedding_column: str = "embedding"
    key_column: str = ""
    """The primary key (joins in hybrid search); the id column when empty."""
    tsv_column: str | None = None
    """The full-text column, when the table has one (see :func:`text_search_column`)."""
    ts_config: str | None = None
    """Text search configuration the full-text column was built with."""
    collection_id: str | None = None
    """The collection's UUID, for ``langchain_legacy``."""
    collection: str | None = None
    """The collection's name, for ``langchain_legacy``."""

    def __post_init__(self) -> None:
        if not self.key_column:
            object.__setattr__(self, "key_column", self.id_column)

    @classmethod
    def for_target(cls, name: str, target: Target = "llamaindex") -> TableLayout:
        """The layout for logical table ``name`` (validated, lower-cased)."""
        name = validate_table_name(name)
        if target == "llamaindex":
            return cls("llamaindex", f"data_{name}", "node_id", "text", "metadata_", key_column="id")
        if target == "langchain":
            if is_reserved_word(name):  # the physical name: SQL here and in LangChain's code
                raise ValueError(
                    f"Invalid table name {name!r} for the langchain target: it is a reserved word "
                    f"in PostgreSQL; choose another name (e.g. '{name}_docs'), or use the "
                    f"llamaindex target (stored as data_{name})."
                )
            return cls("langchain", name, "langchain_id", "content", "langchain_metadata")
        raise ValueError(f"Unknown target {target!r}; use 'llamaindex' or 'langchain'.")

    @property
    def source_expr(self) -> str:
        """SQL for a row's source path (indexed: LlamaIndex's ``ref_doc_id`` index, or ours)."""
        key = "ref_doc_id" if self.target == "llamaindex" else "source"
        return f"({self.metadata_column}->>'{key}')"

    @property
    def where_sql(self) -> Any:
        """``psycopg.sql`` restricting rows to this layout's (the collection, for legacy)."""
        from psycopg import sql

        if self.collection_id is None:
            return sql.SQL("TRUE")
        return sql.SQL("collection_id = {}::uuid").format(sql.Literal(self.collection_id))


def table_columns(conn: Any, table: str) -> set[str] | None:
    """Column names of ``table`` (on the search path), or ``None`` when there is no such table."""
    row = conn.execute("SELECT to_regclass(%s)::oid", (table,)).fetchone()
    if not row or row[0] is None:
        return None
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (row[0],),
    ).fetchall()
    return {r[0] for r in rows}


def check_layout(conn: Any, layout: TableLayout, where: str) -> bool:
    """Whether ``layout``'s table exists; raises when a table of that name is not tokrag's.

    Raises:
        PostgresQueryError: A table with that name exists without the layout's columns
            (another application's table): it is neither written to nor read.
    """
    columns = table_columns(conn, layout.table)
    if columns is None:
        return False
    needed = [layout.id_column, layout.text_column, layout.metadata_column, layout.embedding_column]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise PostgresQueryError(
            f"Table {layout.table} at {where} exists but is not a tokrag {layout.target} table "
            f"(it has no {', '.join(missing)} column{'s' if len(missing) > 1 else ''}); pass "
            "another --table, or rename or drop that table if it is not needed."
        )
    return True


# ============================================================================ full text
_TS_EXPR = re.compile(r"to_tsvector\('([a-z_][a-z0-9_]*)'::regconfig")


def text_search_column(conn: Any, layout: TableLayout) -> tuple[str | None, str | None]:
    """``(column, configuration)`` of the table's full-text column, or ``(None, None)``.

    The column is :data:`~.search.TSV_COLUMN` of type ``tsvector``; its configuration is read
    from its generation expression (``to_tsvector('english'::regconfig, text)``), ``None``
    when it is not a generated column.
    """
    from .search import TSV_COLUMN

    row = conn.execute(
        "SELECT format_type(a.atttypid, a.atttypmod), pg_get_expr(d.adbin, d.adrelid) "
        "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
        (layout.table, TSV_COLUMN),
    ).fetchone()
    if not row or row[0] != "tsvector":
        return None, None
    match = _TS_EXPR.search(row[1] or "")
    return TSV_COLUMN, match.group(1) if match else None


def add_text_search(conn: Any, layout: TableLayout, config: str, *, lock: bool = True) -> None:
    """Add the generated full-text column and its GIN index to ``layout``'s table.

    ``ALTER TABLE ... ADD COLUMN text_search_tsv tsvector GENERATED ALWAYS AS
    (to_tsvector(config, text)) STORED`` rewrites the table (every row's vector is computed),
    under an ``ACCESS EXCLUSIVE`` lock, in one transaction with the index. Nothing is done
    when the column exists. ``lock=False`` when the caller already holds the table's
    creation lock (``tokrag:create:<table>``) on another connection.

    Raises:
        ValueError: The server has no text search configuration ``config``.
    """
    from psycopg import sql

    from .search import TSV_COLUMN, ts_config_exists

    ts_config_exists(conn, config)
    with conn.transaction():
        if lock:
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"tokrag:create:{layout.table}",),
            )
        if text_search_column(conn, layout)[0]:
            return
        conn.execute(
            sql.SQL(
                "ALTER TABLE {table} ADD COLUMN {tsv} tsvector "
                "GENERATED ALWAYS AS (to_tsvector({config}::regconfig, {text})) STORED"
            ).format(
                table=sql.Identifier(layout.table),
                tsv=sql.Identifier(TSV_COLUMN),
                config=sql.Literal(config),
                text=sql.Identifier(layout.text_column),
            )
        )
        conn.execute(
            sql.SQL("CREATE INDEX IF NOT EXISTS {index} ON {table} USING gin ({tsv})").format(
                index=sql.Identifier(f"{layout.table}_{TSV_COLUMN}_idx"[:63]),
                table=sql.Identifier(layout.table),
                tsv=sql.Identifier(TSV_COLUMN),
            )
        )


# ============================================================================ legacy PGVector
def legacy_collection(conn: Any, name: str) -> TableLayout | None:
    """The layout of the older langchain-postgres ``PGVector`` collection ``name``, or ``None``
    when there is no such collection (or no ``langchain_pg_collection`` table)."""
    collections = table_columns(conn, "langchain_pg_collection")
    embeddings = table_columns(conn, "langchain_pg_embedding")
    if not collections or not embeddings or not {"uuid", "name"} <= collections:
        return None
    needed = {"id", "collection_id", "embedding", "document", "cmetadata"}
    if not needed <= embeddings:
        return None
    row = conn.execute(
        "SELECT uuid::text FROM langchain_pg_collection WHERE name = %s", (name,)
    ).fetchone()
    if not row:
        return None
    return TableLayout(
        "langchain_legacy",
        "langchain_pg_embedding",
        "id",
        "document",
        "cmetadata",
        collection_id=row[0],
        collection=name,
    )


def detect_layout(
    conn: Any, table: str, where: str, target: Target | None = None, collection: str | None = None
) -> TableLayout:
    """The layout of ``table`` found on ``conn`` (``where``: the masked connection string, for
    messages): ``data_<table>`` (LlamaIndex schema), ``<table>`` (langchain-postgres), else
    a legacy ``PGVector`` collection named ``table`` (or ``collection``), with its full-text
    column.

    Raises:
        LookupError: None of them is there.
        PostgresQueryError: A table of that name is not one tokrag can read.
    """
    candidates = [TableLayout.for_target(table, t) for t in (target,) if t] or [
        TableLayout.for_target(table, t)
        for t in ("llamaindex", "langchain")
        if t == "llamaindex" or not is_reserved_word(table)  # never a langchain table
    ]
    if collection is not None:
        candidates = []
    found = None
    for layout in candidates:
        # A table of that name without our columns is an error, never read.
        if check_layout(conn, layout, where):
            found = layout
            break
    if found is None and not target:
        found = legacy_collection(conn, collection or table)
    if found is not None:
        column, config = text_search_column(conn, found)
        return replace(found, tsv_column=column, ts_config=config)
    if collection is not None:
        raise LookupError(
            f"No langchain-postgres PGVector collection {collection!r} at {where} "
            "(no such name in langchain_pg_collection)."
        )
    names = " or ".join(c.table for c in candidates)
    raise LookupError(
        f"No ingested table {names} at {where} (nor a langchain-postgres PGVector "
        f"collection {table!r}). Run `tokrag ingest PATH --table {table}` first "
        "(with the same --dsn)."
    )
