"""LlamaIndex's and LangChain's own stores over the ingested table, and the retrievers.

**Metadata filters are parameterised.** Values (and keys) are bound parameters; keys are
also checked by :func:`validate_filter_key` (ASCII identifiers only). Values may contain
anything (quotes, semicolons, unicode). ``PGVectorStore`` (llama-index-vector-stores-postgres
0.9) formats filter keys *and values* into SQL text; :func:`make_llamaindex_store` (kept for
direct use of LlamaIndex's store and for creating tables) returns a subclass whose
``_build_filter_clause`` builds SQLAlchemy expressions with bound parameters instead.

The same table can also be read by ``langchain-postgres``' ``PGVectorStore`` with custom
column names (:meth:`~PostgresKnowledgeBase.langchain_store`)::

    table_name="data_<table>", id_column="node_id", content_column="text",
    embedding_column="embedding", metadata_json_column="metadata_"
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any

from ..config import require_bool
from .layout import TableLayout
from .search import Filters, validate_filter_key, validate_ts_config
from .server import (
    ResolvedDatabase,
    connect_timeout,
    sqlalchemy_url,
    start_again_if_stopped,
)

__all__ = ["FrameworkStores", "close_llamaindex_store", "make_llamaindex_store"]

_SAFE_STORE_CLASS: Any = None


def _safe_store_class() -> Any:
    """``PGVectorStore`` with bound-parameter metadata filters (see the module docstring)."""
    global _SAFE_STORE_CLASS
    if _SAFE_STORE_CLASS is not None:
        return _SAFE_STORE_CLASS
    import sqlalchemy
    from llama_index.core.vector_stores.types import FilterOperator
    from llama_index.vector_stores.postgres import PGVectorStore

    class SafeFilterPGVectorStore(PGVectorStore):
        """``PGVectorStore`` whose metadata filters are bound parameters, never SQL text."""

        def _initialize(self) -> None:
            # tokrag sets initialization_fail_on_error, so a setup error (e.g. no CREATE
            # privilege) is raised and reported in one sentence; PGVectorStore would first log
            # it as a warning with its whole SQL statement. Dropped in this thread only.
            if not self.perform_setup or self._is_initialized:
                return super()._initialize()
            thread = threading.get_ident()

            def raised_anyway(record: logging.LogRecord) -> bool:
                return record.thread != thread or not str(record.msg).startswith("PG Setup: Error")

            setup_logger = logging.getLogger(PGVectorStore.__module__)
            setup_logger.addFilter(raised_anyway)
            try:
                return super()._initialize()
            finally:
                setup_logger.removeFilter(raised_anyway)

        def _build_filter_clause(self, filter_: Any) -> Any:
            key = validate_filter_key(filter_.key)
            field_ = self._table_class.metadata_[key].astext  # ->> with the key bound too
            op, value = filter_.operator, filter_.value

            def typed(v: Any) -> Any:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return sqlalchemy.cast(field_, sqlalchemy.Float), float(v)
                return field_, str(v)

            if op in (FilterOperator.EQ, FilterOperator.NE, FilterOperator.GT, FilterOperator.LT,
                      FilterOperator.GTE, FilterOperator.LTE):  # fmt: skip
                column, bound = typed(value)
                return {
                    FilterOperator.EQ: column == bound,
                    FilterOperator.NE: column != bound,
                    FilterOperator.GT: column > bound,
                    FilterOperator.LT: column < bound,
                    FilterOperator.GTE: column >= bound,
                    FilterOperator.LTE: column <= bound,
                }[op]
            if op in (FilterOperator.IN, FilterOperator.NIN):
                values = [str(v) for v in value]
                return field_.in_(values) if op == FilterOperator.IN else field_.not_in(values)
            if op in (FilterOperator.TEXT_MATCH, FilterOperator.TEXT_MATCH_INSENSITIVE):
                pattern = "%" + re.sub(r"([%_\\])", r"\\\1", str(value)) + "%"
                if op == FilterOperator.TEXT_MATCH:
                    return field_.like(pattern, escape="\\")
                return field_.ilike(pattern, escape="\\")
            if op == FilterOperator.IS_EMPTY:
                return field_.is_(None)
            if op in (FilterOperator.CONTAINS, FilterOperator.ANY, FilterOperator.ALL):
                from sqlalchemy.dialects.postgresql import JSONB

                stored = sqlalchemy.cast(self._table_class.metadata_[key], JSONB)
                values = list(value) if isinstance(value, (list, tuple)) else [value]

                def holds(items: list[Any]) -> Any:  # the JSON array is a bound parameter
                    return stored.op("@>")(sqlalchemy.cast(sqlalchemy.literal(json.dumps(items)), JSONB))

                if op == FilterOperator.ANY:
                    return sqlalchemy.or_(*(holds([v]) for v in values))
                return holds(values)  # CONTAINS (one value) and ALL
            raise ValueError(
                f"Filter operator {op.value!r} is not supported here; use ==, !=, <, >, <=, >=, "
                "in, nin, contains, any, all, text_match or is_empty."
            )

    _SAFE_STORE_CLASS = SafeFilterPGVectorStore
    return _SAFE_STORE_CLASS


def make_llamaindex_store(
    db: ResolvedDatabase,
    layout: TableLayout,
    embed_dim: int,
    *,
    setup: bool = False,
    ef_search: int = 40,
    hybrid_search: bool = False,
    text_search_config: str = "english",
) -> Any:
    """A LlamaIndex ``PGVectorStore`` (safe-filter subclass) over ``layout``'s table.

    With ``setup=True`` the store creates the extension, table, ``ref_doc_id`` index and the
    HNSW index (``m=16, ef_construction=64``, cosine) on first use; errors are raised, not
    logged and swallowed. With ``hybrid_search=True`` the table also gets LlamaIndex's
    generated ``text_search_tsv`` column (``to_tsvector(text_search_config, text)``) and its
    GIN index; ``text_search_config`` is checked to be a plain name first (LlamaIndex
    formats it into its DDL).
    """
    require_bool(setup, "setup")
    require_bool(hybrid_search, "hybrid_search")
    validate_ts_config(text_search_config)
    if layout.target != "llamaindex":
        raise ValueError(
            f"Table {layout.table} uses LangChain's layout; LlamaIndex cannot read it. Ingest "
            "with --target llamaindex (readable by both frameworks)."
        )
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import create_async_engine

    hnsw = {"hnsw_ef_search": ef_search}
    if setup:
        hnsw.update(hnsw_m=16, hnsw_ef_construction=64, hnsw_dist_method="vector_cosine_ops")
    connect_args = {"connect_timeout": connect_timeout()}
    # The sync engine uses psycopg2: PGVectorStore runs ``SET hnsw.ef_search = :value``, which
    # only works with client-side parameter binding (psycopg 3 binds on the server, where SET
    # takes no parameters). The async path formats that value into the SQL itself, so it can
    # use psycopg 3's async driver.
    engine = create_engine(
        sqlalchemy_url(db.dsn, "psycopg2"), connect_args=connect_args, pool_pre_ping=True
    )
    async_engine = create_async_engine(
        sqlalchemy_url(db.dsn, "psycopg"), connect_args=connect_args, pool_pre_ping=True
    )
    _start_again_before_connecting(engine, db.dsn)
    _start_again_before_connecting(async_engine, db.dsn)
    # The engines above are what the store uses; the strings are only kept as pydantic fields
    # (shown by repr and model_dump), so they are given with the password hidden.
    return _safe_store_class()(
        connection_string=sqlalchemy_url(db.dsn, "psycopg2", hide_password=True),
        async_connection_string=sqlalchemy_url(db.dsn, "psycopg", hide_password=True),
        table_name=layout.table.removeprefix("data_"),
        embed_dim=embed_dim,
        use_jsonb=True,
        hybrid_search=hybrid_search,
        text_search_config=text_search_config,
        hnsw_kwargs=hnsw,
        perform_setup=setup,
        initialization_fail_on_error=True,
        engine=engine,
        async_engine=async_engine,
    )


def _start_again_before_connecting(engine: Any, dsn: str) -> None:
    """Before ``engine`` opens a connection, start this process's embedded server again if
    it was stopped from outside (:func:`~.server.start_again_if_stopped`). With
    ``pool_pre_ping`` the pooled connections to the stopped server are replaced, so the call
    that finds it stopped goes on after the restart."""
    from sqlalchemy import event

    def before_connect(*_: Any) -> None:  # returning None: connect as usual
        start_again_if_stopped(dsn)

    event.listen(getattr(engine, "sync_engine", engine), "do_connect", before_connect)


def close_llamaindex_store(store: Any) -> None:
    """Dispose the sync engine ``PGVectorStore`` opened (its async engine is never connected
    by our code paths; ``await store.close()`` disposes both)."""
    engine = getattr(store, "_engine", None)
    if engine is not None:
        engine.dispose()


class FrameworkStores:
    """The framework views of :class:`~.store.PostgresKnowledgeBase` (a mixin: it uses the
    knowledge base's ``db``, ``layout``, ``embedder``, ``_lock`` and ``_check_request``)."""

    db: ResolvedDatabase
    layout: TableLayout
    embedder: Any
    ef_search: int
    text_search_config: str

    def llamaindex_store(self) -> Any:
        """The LlamaIndex ``PGVectorStore`` over the table (created once, shared).

        Only for code that needs LlamaIndex's store itself; :meth:`llamaindex_retriever` and
        :meth:`retrieve` do not use it.
        """
        with self._lock:
            if self._li_store is None:
                self._li_store = make_llamaindex_store(
                    self.db,
                    self.layout,
                    self.embedder.dim,
                    ef_search=self.ef_search,
                    # its own hybrid / sparse queries need the column in its table class
                    hybrid_search=self.layout.tsv_column is not None,
                    text_search_config=self.layout.ts_config or self.text_search_config,
                )
            return self._li_store

    def llamaindex_retriever(
        self, top_k: int = 4, filters: Filters = None, **search_options: Any
    ) -> Any:
        """A LlamaIndex ``BaseRetriever`` over the table (sync and async), with filters.

        ``search_options`` are :meth:`retrieve`'s keyword arguments (``search``, ``rrf_k``,
        ``vector_weight``, ``text_weight``, ``candidates``); they are checked here.
        """
        from .adapters import llamaindex_retriever

        self._check_request(top_k, filters, **search_options)
        return llamaindex_retriever(self, top_k=top_k, filters=filters, **search_options)

    def langchain_store(self) -> Any:
        """A ``langchain_postgres.PGVectorStore`` over the same table (custom column names).

        Only for code that needs LangChain's store itself; :meth:`langchain_retriever` and
        :meth:`retrieve` do not use it.
        """
        if self.layout.target == "langchain_legacy":
            raise ValueError(
                f"Collection {self.layout.collection!r} is a legacy langchain-postgres PGVector "
                "collection; read it with langchain_postgres.PGVector(collection_name=...) or "
                "through langchain_retriever()."
            )
        with self._lock:
            if self._lc_store is None:
                from langchain_postgres import PGEngine, PGVectorStore

                self._lc_engine = PGEngine.from_connection_string(
                    sqlalchemy_url(self.db.dsn),
                    connect_args={"connect_timeout": connect_timeout()},
                    pool_pre_ping=True,
                )
                _start_again_before_connecting(self._lc_engine._pool, self.db.dsn)
                lay = self.layout
                self._lc_store = PGVectorStore.create_sync(
                    self._lc_engine,
                    embedding_service=self.embedder.langchain(),
                    table_name=lay.table,
                    id_column=lay.id_column,
                    content_column=lay.text_column,
                    embedding_column=lay.embedding_column,
                    metadata_json_column=lay.metadata_column,
                )
            return self._lc_store

    def langchain_retriever(self, k: int = 4, filters: Filters = None, **search_options: Any) -> Any:
        """A LangChain ``BaseRetriever`` over the table (``invoke`` / ``ainvoke``), with filters;
        ``search_options`` as for :meth:`llamaindex_retriever`."""
        from .adapters import langchain_retriever

        self._check_request(k, filters, name="k", **search_options)
        return langchain_retriever(self, k=k, filters=filters, **search_options)

    def _close_stores(self) -> None:
        """Release the framework stores' engines."""
        with self._lock:
            if self._li_store is not None:
                close_llamaindex_store(self._li_store)
                self._li_store = None
            if self._lc_engine is not None:
                self._lc_engine._run_as_sync(self._lc_engine._pool.dispose())
                self._lc_engine = None
                self._lc_store = None
