"""Creating the table ``tokrag ingest`` writes into, and checking that an existing one fits
the embedder (same model, same dimension) and has its full-text column."""

from __future__ import annotations

from typing import Any

from .embeddings import Embedder
from .layout import TableLayout, check_layout
from .pool import pooled
from .server import ResolvedDatabase, connect, database_errors

__all__ = ["ensure_table"]


def _vector_dim(conn: Any, layout: TableLayout) -> int | None:
    row = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped",
        (layout.table, layout.embedding_column),
    ).fetchone()
    if not row:
        return None
    digits = "".join(ch for ch in str(row[0]) if ch.isdigit())
    return int(digits) if digits else None


def _stored_models(conn: Any, layout: TableLayout) -> set[str]:
    rows = conn.execute(
        f"SELECT DISTINCT {layout.metadata_column}->>'embed_model' FROM {layout.table}"
    ).fetchall()
    return {r[0] for r in rows if r[0] is not None}


def ensure_table(
    db: ResolvedDatabase,
    layout: TableLayout,
    embedder: Embedder,
    *,
    text_search_config: str = "english",
    upgrade: bool = False,
) -> str:
    """Create the table (its HNSW index, its full-text column and GIN index) if missing;
    check an existing one fits. Returns a note for the summary (``""`` when none).

    A table without the full-text column (ingested before tokrag made one) gets it when
    ``upgrade`` (:func:`~.layout.add_text_search`); otherwise the note says how.

    Creation runs under a session-level advisory lock on the table name, so concurrent
    first ingests into a new table create it once (without the lock, ``CREATE TABLE IF NOT
    EXISTS`` races on ``pg_class_relname_nsp_index``); the others wait, then find it.

    Raises:
        ValueError: The table exists with another embedding size or holds chunks embedded by
            a different model (mixing models would make every similarity meaningless).
        PostgresQueryError: A table of that name exists but is not a tokrag table, or the
            database user may not create or read it.
    """
    from .layout import add_text_search, text_search_column
    from .search import ts_config_exists

    note = ""
    with database_errors(db.dsn, f"prepare table {layout.table}"):
        with pooled(db.dsn) as conn:
            ts_config_exists(conn, text_search_config)
            conn.execute(
                "SELECT pg_advisory_lock(hashtextextended(%s, 0))", (f"tokrag:create:{layout.table}",)
            )
            try:
                if not check_layout(conn, layout, db.masked):
                    _create_table(db, layout, embedder.dim, text_search_config)
                dim = _vector_dim(conn, layout)
            finally:
                conn.execute(
                    "SELECT pg_advisory_unlock(hashtextextended(%s, 0))",
                    (f"tokrag:create:{layout.table}",),
                )
            if dim != embedder.dim:
                raise ValueError(
                    f"Table {layout.table} stores {dim}-dimensional embeddings but "
                    f"{embedder.name} makes {embedder.dim}-dimensional ones. Use the model the "
                    "table was built with (--embed-model), or another --table."
                )
            others = _stored_models(conn, layout) - {embedder.name}
            if not others and dim == embedder.dim and text_search_column(conn, layout)[0] is None:
                if upgrade:
                    add_text_search(conn, layout, text_search_config)
                    note = (
                        f"added the full-text column ({text_search_config}) and its GIN index "
                        f"to {layout.table}: text and hybrid search work now"
                    )
                else:
                    note = (
                        f"table {layout.table} has no full-text column (it was made before "
                        "tokrag added one), so search='text' and 'hybrid' cannot use it; re-run "
                        "with --upgrade (upgrade=True) to add it (rewrites the table once)"
                    )
    if others:
        raise ValueError(
            f"Table {layout.table} holds chunks embedded with {sorted(others)}, not "
            f"{embedder.name}; pass the same --embed-model, or use another --table."
        )
    return note


def _create_table(
    db: ResolvedDatabase, layout: TableLayout, dim: int, ts_config: str = "english"
) -> None:
    if layout.target == "llamaindex":
        from .framework_stores import close_llamaindex_store, make_llamaindex_store

        # hybrid_search=True: LlamaIndex's own generated text_search_tsv column and GIN index
        store = make_llamaindex_store(
            db, layout, dim, setup=True, hybrid_search=True, text_search_config=ts_config
        )
        try:
            store.add([])  # the public way to run PGVectorStore's table/index setup
        finally:
            close_llamaindex_store(store)
    else:
        _create_langchain_table(db, layout, dim, ts_config)


def _create_langchain_table(
    db: ResolvedDatabase, layout: TableLayout, dim: int, ts_config: str = "english"
) -> None:
    from langchain_postgres import PGEngine
    from psycopg import sql

    from .server import connect_timeout, sqlalchemy_url

    engine = PGEngine.from_connection_string(
        sqlalchemy_url(db.dsn), connect_args={"connect_timeout": connect_timeout()}
    )
    try:
        engine.init_vectorstore_table(layout.table, dim)
    finally:
        engine._run_as_sync(engine._pool.dispose())
    # The table was just created (under ensure_table's lock): without its indexes it is
    # dropped again, so a failure leaves nothing half-made behind.
    with connect(db.dsn, autocommit=True) as conn:
        try:
            with conn.transaction():
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {layout.table}_hnsw_idx ON {layout.table} USING "
                    f"hnsw ({layout.embedding_column} vector_cosine_ops) WITH (m = 16, ef_construction = 64)"
                )
                conn.execute(
                    f"CREATE INDEX IF NOT EXISTS {layout.table}_source_idx ON {layout.table} "
                    f"({layout.source_expr})"
                )
            from .layout import add_text_search

            add_text_search(conn, layout, ts_config, lock=False)  # ensure_table holds it
        except Exception:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(layout.table)))
            raise
