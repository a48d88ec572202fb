"""The tables tokrag writes and reads (LlamaIndex's ``PGVectorStore`` schema and
langchain-postgres' ``PGEngine`` default columns; read only, the older ``PGVector``
collections), their full-text column, and creating them (:func:`ensure_table`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..retrieval.embedder import Embedder
from .connection import ResolvedDatabase, pooled
from .dsn import PostgresQueryError, database_errors
from .search import ts_config_exists

#: Table name used when none is given (LlamaIndex stores it as ``data_<name>``).
DEFAULT_TABLE = "tokrag_docs"
#: The full-text column: the name ``PGVectorStore(hybrid_search=True)`` gives it.
TSV_COLUMN = "text_search_tsv"
# LlamaIndex creates ``data_<name>`` and indexes ``data_<name>_embedding_idx``; Postgres
# silently truncates identifiers past 63 bytes, so the name is kept well under that.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")
#: PostgreSQL 16 keywords that cannot name a table unquoted, beyond SQLAlchemy's list of its
#: reserved words (``pg_get_keywords()`` categories R and T; a test compares with the server).
_MORE_RESERVED = frozenset({"collation", "concurrently", "lateral", "system_user", "tablesample"})
_TS_EXPR = re.compile(r"to_tsvector\('([a-z_][a-z0-9_]*)'::regconfig")


def validate_table_name(table: str) -> str:
    """The table name, lower-cased: 1-40 ASCII letters, digits and underscores, starting with
    a letter or underscore (it goes into DDL that cannot take bind parameters); else a
    ``ValueError`` saying so."""
    if not isinstance(table, str) or not _TABLE_RE.fullmatch(table):
        raise ValueError(
            f"Invalid table name {table!r}: use 1-40 ASCII letters, digits and underscores, "
            "starting with a letter or underscore (e.g. 'tokrag_docs')."
        )
    return table.lower()


def is_reserved_word(name: str) -> bool:
    """Whether ``name`` cannot be a table name in SQL unquoted (``user``, ``order``...)."""
    from sqlalchemy.dialects.postgresql.base import RESERVED_WORDS

    return name.lower() in RESERVED_WORDS or name.lower() in _MORE_RESERVED


Target = Literal["llamaindex", "langchain"]


@dataclass(frozen=True)
class TableLayout:
    """Physical table and column names of one of the supported layouts."""

    target: str
    """``"llamaindex"``, ``"langchain"`` or ``"langchain_legacy"`` (read only)."""
    table: str
    """Physical table name (``data_<name>`` for LlamaIndex)."""
    id_column: str
    text_column: str
    metadata_column: str
    key_column: str
    """The primary key (joins in hybrid search)."""
    embedding_column: str = "embedding"
    tsv_column: str | None = None
    """The full-text column, when the table has one (see :func:`text_search_column`)."""
    ts_config: str | None = None
    """Text search configuration the full-text column was built with."""
    collection_id: str | None = None
    """The collection's UUID, for ``langchain_legacy``."""
    collection: str | None = None
    """The collection's name, for ``langchain_legacy``."""

    @classmethod
    def for_target(cls, name: str, target: Target = "llamaindex") -> TableLayout:
        """The layout for logical table ``name`` (validated, lower-cased)."""
        name = validate_table_name(name)
        if target == "llamaindex":
            return cls("llamaindex", f"data_{name}", "node_id", "text", "metadata_", "id")
        if target == "langchain":
            if is_reserved_word(name):  # the physical name: SQL here and in LangChain's code
                raise ValueError(
                    f"Invalid table name {name!r} for the langchain target: it is a reserved word "
                    f"in PostgreSQL; choose another name (e.g. '{name}_docs'), or use the "
                    f"llamaindex target (stored as data_{name})."
                )
            return cls(
                "langchain", name, "langchain_id", "content", "langchain_metadata", "langchain_id"
            )
        raise ValueError(f"Unknown target {target!r}; use 'llamaindex' or 'langchain'.")

    @property
    def source_expr(self) -> str:
        """SQL for a row's source path (indexed: LlamaIndex's ``ref_doc_id`` index, or ours)."""
        key = "ref_doc_id" if self.target == "llamaindex" else "source"
        return f"({self.metadata_column}->>'{key}')"

    @property
    def lock_key(self) -> str:
        """Key of the advisory lock held while the table is created or altered."""
        return f"tokrag:create:{self.table}"

    @property
    def where_sql(self) -> Any:
        """``psycopg.sql`` restricting rows to the legacy layout's collection."""
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
    """Whether ``layout``'s table exists; a table of that name without the layout's columns
    (another application's) raises :class:`PostgresQueryError`: it is neither written nor read."""
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


def _column_type(conn: Any, table: str, column: str) -> tuple[str, str | None]:
    """``(type, generation expression)`` of a column of ``table``; ``("", None)`` if none."""
    row = conn.execute(
        "SELECT format_type(a.atttypid, a.atttypmod), pg_get_expr(d.adbin, d.adrelid) "
        "FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
        "WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
        (table, column),
    ).fetchone()
    return (str(row[0]), row[1]) if row else ("", None)


def check_embedder(conn: Any, layout: TableLayout, embedder: Embedder) -> None:
    """Refuse ``embedder`` for a table holding embeddings of another size or chunks embedded
    by another model (mixing models would make every similarity meaningless).

    Raises:
        ValueError: Naming both sizes or models and the fix.
    """
    from psycopg import sql

    names = dict(
        meta=sql.Identifier(layout.metadata_column),
        emb=sql.Identifier(layout.embedding_column),
        table=sql.Identifier(layout.table),
        where=layout.where_sql,
    )
    kind = _column_type(conn, layout.table, layout.embedding_column)[0]
    digits = "".join(ch for ch in kind if ch.isdigit())
    if digits:
        dim = int(digits)
    else:  # an untyped vector column (legacy PGVector): the stored embeddings say
        query = sql.SQL("SELECT vector_dims({emb}) FROM {table} WHERE {where} LIMIT 1")
        row = conn.execute(query.format(**names)).fetchone()
        dim = row[0] if row else embedder.dim
    if dim != embedder.dim:
        raise ValueError(
            f"Table {layout.table} stores {dim}-dimensional embeddings but {embedder.name} "
            f"makes {embedder.dim}-dimensional ones. Use the model the table was built with "
            "(--embed-model), or another --table."
        )
    query = sql.SQL(
        "SELECT {meta}->>'embed_model' FROM {table} WHERE {where} "
        "AND {meta}->>'embed_model' <> %s LIMIT 1"
    )
    other = conn.execute(query.format(**names), (embedder.name,)).fetchone()
    if other:
        raise ValueError(
            f"Table {layout.table} holds chunks embedded with {other[0]!r}, not "
            f"{embedder.name!r}; pass the same --embed-model as at ingest, or use another --table."
        )


# ============================================================================ full text
def text_search_column(conn: Any, layout: TableLayout) -> tuple[str | None, str | None]:
    """``(column, configuration)`` of the table's ``tsvector`` column :data:`TSV_COLUMN`, or
    ``(None, None)``; the configuration is read from its generation expression."""
    kind, expression = _column_type(conn, layout.table, TSV_COLUMN)
    if kind != "tsvector":
        return None, None
    match = _TS_EXPR.search(expression or "")
    return TSV_COLUMN, match.group(1) if match else None


def add_text_search(conn: Any, layout: TableLayout, config: str, *, lock: bool = True) -> None:
    """Add the generated full-text column (``to_tsvector(config, text)``) and its GIN index
    to ``layout``'s table, in one transaction; nothing when it has one. ``lock=False`` when
    the caller holds the table's creation lock already.

    Raises:
        ValueError: The server has no text search configuration ``config``.
    """
    from psycopg import sql

    ts_config_exists(conn, config)
    with conn.transaction():
        if lock:
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (layout.lock_key,)
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
    needed = {"id", "collection_id", "embedding", "document", "cmetadata"}
    if not collections or not embeddings or not {"uuid", "name"} <= collections:
        return None
    if not needed <= embeddings:
        return None
    row = conn.execute(
        "SELECT uuid::text FROM langchain_pg_collection WHERE name = %s", (name,)
    ).fetchone()
    return row and TableLayout(
        "langchain_legacy", "langchain_pg_embedding", "id", "document", "cmetadata", "id",
        collection_id=row[0], collection=name,
    )  # fmt: skip


def detect_layout(
    conn: Any, table: str, where: str, target: Target | None = None, collection: str | None = None
) -> TableLayout:
    """The layout of ``table`` on ``conn`` (``where``: the masked DSN): ``data_<table>``
    (LlamaIndex), ``<table>`` (langchain-postgres), else a legacy ``PGVector`` collection named
    ``table`` (or ``collection``), with its full-text column.

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
    # A table of that name without our columns is an error, never read.
    found = next((layout for layout in candidates if check_layout(conn, layout, where)), None)
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


# ============================================================================ creation
def ensure_table(
    db: ResolvedDatabase,
    layout: TableLayout,
    embedder: Embedder,
    *,
    text_search_config: str = "english",
    upgrade: bool = False,
) -> str:
    """Create the table (HNSW index, full-text column and GIN index) if missing, under an
    advisory lock on its name so concurrent first ingests create it once, or check that an
    existing one fits; returns a note for the summary (``""`` when none). A table without
    the full-text column gets it when ``upgrade``, else the note says how.

    Raises:
        ValueError: The table does not fit ``embedder`` (:func:`check_embedder`).
        PostgresQueryError: A table of that name exists but is not a tokrag table, or the
            database user may not create or read it.
    """
    with database_errors(db.dsn, f"prepare table {layout.table}"), pooled(db.dsn) as conn:
        ts_config_exists(conn, text_search_config)
        conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (layout.lock_key,))
        try:
            if not check_layout(conn, layout, db.masked):
                _create_table(db, conn, layout, embedder.dim, text_search_config)
        finally:
            conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 0))", (layout.lock_key,))
        check_embedder(conn, layout, embedder)
        if text_search_column(conn, layout)[0] is not None:
            return ""
        if not upgrade:
            return (
                f"table {layout.table} has no full-text column (it was made before tokrag "
                "added one), so search='text' and 'hybrid' cannot use it; re-run with "
                "--upgrade (upgrade=True) to add it (rewrites the table once)"
            )
        add_text_search(conn, layout, text_search_config)
    return (
        f"added the full-text column ({text_search_config}) and its GIN index to "
        f"{layout.table}: text and hybrid search work now"
    )


def _create_table(
    db: ResolvedDatabase, conn: Any, layout: TableLayout, dim: int, ts_config: str
) -> None:
    """Create ``layout``'s table: LlamaIndex's by its ``PGVectorStore`` (with its own
    full-text column and GIN index); LangChain's with ``PGEngine.init_vectorstore_table``'s
    columns, its HNSW and source indexes and the full-text column, in one transaction, so a
    failure leaves nothing behind."""
    if layout.target == "llamaindex":
        from .frameworks import close_llamaindex_store, make_llamaindex_store

        store = make_llamaindex_store(
            db, layout, dim, setup=True, hybrid_search=True, text_search_config=ts_config
        )
        try:
            store.add([])  # the public way to run PGVectorStore's table/index setup
        finally:
            close_llamaindex_store(store)
        return
    t, embedding = layout.table, layout.embedding_column
    with conn.transaction():
        conn.execute(
            f"CREATE TABLE {t} ({layout.id_column} uuid PRIMARY KEY, {layout.text_column} text "
            f"NOT NULL, {embedding} vector({dim}) NOT NULL, {layout.metadata_column} json)"
        )
        conn.execute(
            f"CREATE INDEX IF NOT EXISTS {t}_hnsw_idx ON {t} USING hnsw "
            f"({embedding} vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
        )
        conn.execute(f"CREATE INDEX IF NOT EXISTS {t}_source_idx ON {t} ({layout.source_expr})")
        add_text_search(conn, layout, ts_config, lock=False)  # ensure_table holds the lock
