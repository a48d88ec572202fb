"""Reading the ingested table: vector, full-text or hybrid search, LlamaIndex and LangChain
retrievers, and answers from it.

:meth:`PostgresKnowledgeBase.retrieve` runs one SQL statement (:mod:`.search`) on a
connection of the process's shared psycopg pool (:mod:`.pool`) for every layout tokrag
reads: its own LlamaIndex-schema table (also one made by ``PGVectorStore(hybrid_search=True)``),
its ``langchain-postgres`` table, and a collection of the older langchain-postgres
``PGVector``. ``search="vector" | "text" | "hybrid"`` picks the ranking (hybrid: reciprocal
rank fusion of the two, in the same statement). :meth:`~PostgresKnowledgeBase.llamaindex_retriever`
and :meth:`~PostgresKnowledgeBase.langchain_retriever` are thin adapters over it
(:mod:`.adapters`), so both frameworks get every search mode, every filter operator, the
pool and async retrieval.

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

import asyncio
import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..booleans import require_bool
from .embeddings import Embedder, load_embedder
from .layout import TableLayout, Target, check_layout
from .search import (
    Condition,
    SearchMode,
    check_search,
    parse_filter_args,
    search_statement,
    to_conditions,
    validate_filter_key,
    validate_ts_config,
)
from .server import (
    DEFAULT_TABLE,
    ResolvedDatabase,
    connect_timeout,
    database_errors,
    is_driver_error,
    is_reserved_word,
    query_error,
    resolve_dsn,
    sqlalchemy_url,
    sqlstate_of,
    start_again_if_stopped,
    validate_table_name,
)

__all__ = [
    "PostgresAnswer",
    "PostgresKnowledgeBase",
    "RetrievedChunk",
    "answer_from_postgres",
    "make_llamaindex_store",
    "normalize_filters",
    "parse_filter_args",
    "validate_filter_key",
]

#: Largest ``top_k``: pgvector's HNSW search visits at most ``hnsw.ef_search`` <= 1000 rows.
MAX_TOP_K = 1000

# LlamaIndex's bookkeeping keys, dropped from the metadata we hand to prompts and users.
_INTERNAL_KEYS = frozenset({"_node_content", "_node_type", "doc_id", "document_id", "ref_doc_id"})

Filters = Mapping[str, Any] | Sequence[str] | None


# ============================================================================ filters
def normalize_filters(filters: Filters) -> list[Condition]:
    """Filters as a list of :class:`~.search.Condition` (keys validated, values checked);
    see :func:`~.search.to_conditions` for the accepted forms and operators."""
    return to_conditions(filters)


def _check_top_k(top_k: Any, name: str = "top_k") -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"{name} must be a whole number, got {top_k!r}.")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(
            f"{name} must be between 1 and {MAX_TOP_K} (pgvector's HNSW search returns at "
            f"most {MAX_TOP_K} rows), got {top_k}."
        )


# ============================================================================ LlamaIndex store
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


# ============================================================================ results
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


def _clean_metadata(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (meta or {}).items() if k not in _INTERNAL_KEYS}


# ============================================================================ knowledge base
class PostgresKnowledgeBase:
    """An ingested table plus the embedder it was built with; thread-safe for querying.

    Connects (or starts the embedded server) at construction and fails fast with a masked
    message when the database is unreachable. The layout is detected from the tables
    present: ``data_<table>`` (LlamaIndex schema), ``<table>`` (langchain-postgres), else a
    legacy ``PGVector`` collection named ``table`` (or ``collection``).

    Args:
        dsn: Connection URL; ``None`` uses ``$TOKRAG_PG_DSN`` or the embedded server.
        table: Logical table name given to ``tokrag ingest``.
        embed_model: The ``--embed-model`` used at ingest, if any.
        data_dir: Data folder of the embedded server.
        target: Force the ``"llamaindex"`` or ``"langchain"`` layout instead of detecting it.
        ef_search: HNSW ``ef_search`` (raised to the number of rows asked for).
        search: Default search mode of :meth:`retrieve`: ``"vector"``, ``"text"`` or
            ``"hybrid"``.
        text_search_config: Text search configuration for :meth:`add_text_search`, and for
            queries when the table's full-text column does not say which it was built with.
        rrf_k / vector_weight / text_weight: Default reciprocal rank fusion settings of
            hybrid search (see :mod:`.search`).
        pool_size / pool_timeout: Size of the process's psycopg pool for this database and
            the seconds to wait for a free connection (first user of the database decides;
            default ``$TOKRAG_PG_POOL_SIZE`` or 10, ``$TOKRAG_PG_POOL_TIMEOUT`` or 30).
        collection: Read this collection of the older langchain-postgres ``PGVector``
            (``langchain_pg_embedding``), whatever ``table`` says.
    """

    def __init__(
        self,
        dsn: str | None = None,
        table: str = DEFAULT_TABLE,
        *,
        embed_model: str | Path | None = None,
        data_dir: str | Path | None = None,
        target: Target | None = None,
        ef_search: int = 40,
        search: SearchMode = "vector",
        text_search_config: str = "english",
        rrf_k: float = 60,
        vector_weight: float = 1.0,
        text_weight: float = 1.0,
        pool_size: int | None = None,
        pool_timeout: float | None = None,
        collection: str | None = None,
    ) -> None:
        self.search = check_search(search)
        self.text_search_config = validate_ts_config(text_search_config)
        self.rrf_k, self.vector_weight, self.text_weight = _check_fusion(
            rrf_k, vector_weight, text_weight
        )
        if collection is not None and (not isinstance(collection, str) or not collection):
            raise ValueError(f"collection must be a non-empty string, got {collection!r}.")
        from .pool import pool_settings

        self.pool_size, self.pool_timeout = pool_settings(pool_size, pool_timeout)
        self.db = resolve_dsn(dsn, data_dir=data_dir)
        self.table = validate_table_name(table)
        self.ef_search = ef_search
        with database_errors(self.db.dsn, f"open table {self.table}"):
            self.layout = self._detect_layout(target, collection)
            self.embedder: Embedder = load_embedder(embed_model)
            self._check_embedder()
        self._lock = threading.Lock()
        self._li_store: Any = None
        self._lc_engine: Any = None
        self._lc_store: Any = None

    def __repr__(self) -> str:
        return f"PostgresKnowledgeBase(table={self.layout.table!r}, db={self.db.masked!r})"

    def _connection(self) -> Any:
        """A connection of the shared pool (context manager)."""
        from .pool import pooled, shared_pool

        shared_pool(self.db.dsn, self.pool_size, self.pool_timeout)
        return pooled(self.db.dsn)

    # -------------------------------------------------------------- checks
    def _detect_layout(self, target: Target | None, collection: str | None = None) -> TableLayout:
        from .layout import legacy_collection, text_search_column

        candidates = [TableLayout.for_target(self.table, t) for t in (target,) if t] or [
            TableLayout.for_target(self.table, t)
            for t in ("llamaindex", "langchain")
            if t == "llamaindex" or not is_reserved_word(self.table)  # never a langchain table
        ]
        if collection is not None:
            candidates = []
        with self._connection() as conn:
            found = None
            for layout in candidates:
                # A table of that name without our columns is an error, never read.
                if check_layout(conn, layout, self.db.masked):
                    found = layout
                    break
            if found is None and not target:
                found = legacy_collection(conn, collection or self.table)
            if found is not None:
                column, config = text_search_column(conn, found)
                return replace(found, tsv_column=column, ts_config=config)
        if collection is not None:
            raise LookupError(
                f"No langchain-postgres PGVector collection {collection!r} at {self.db.masked} "
                "(no such name in langchain_pg_collection)."
            )
        names = " or ".join(c.table for c in candidates)
        raise LookupError(
            f"No ingested table {names} at {self.db.masked} (nor a langchain-postgres PGVector "
            f"collection {self.table!r}). Run `tokrag ingest PATH --table {self.table}` first "
            "(with the same --dsn)."
        )

    def _check_embedder(self) -> None:
        from psycopg import sql

        lay = self.layout
        with self._connection() as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT {m}->>'embed_model', vector_dims({e}) FROM {t} WHERE {w} LIMIT 1"
                ).format(
                    m=sql.Identifier(lay.metadata_column),
                    e=sql.Identifier(lay.embedding_column),
                    t=sql.Identifier(lay.table),
                    w=lay.where_sql,
                )
            ).fetchone()
        if row and row[0] and row[0] != self.embedder.name:
            raise ValueError(
                f"Table {lay.table} was embedded with {row[0]!r}, but the query embedder "
                f"is {self.embedder.name!r}; pass the same --embed-model as at ingest."
            )
        if row and row[1] is not None and int(row[1]) != self.embedder.dim:
            raise ValueError(
                f"Table {lay.table} holds {row[1]}-dimensional embeddings but the query "
                f"embedder {self.embedder.name!r} makes {self.embedder.dim}-dimensional ones; "
                "pass the --embed-model the table was built with."
            )

    def _refresh_text_search(self) -> None:
        from .layout import text_search_column

        with database_errors(self.db.dsn, f"open table {self.layout.table}"), self._connection() as conn:
            column, config = text_search_column(conn, self.layout)
        self.layout = replace(self.layout, tsv_column=column, ts_config=config)

    @property
    def has_text_search(self) -> bool:
        """Whether the table has a full-text column (needed by text and hybrid search)."""
        return self.layout.tsv_column is not None

    def add_text_search(self, config: str | None = None) -> None:
        """Add the generated full-text column and its GIN index to the table (an upgrade of a
        table ingested before tokrag made one; rewrites the table). Nothing happens when it
        has one.

        Raises:
            ValueError: The server has no such text search configuration.
        """
        from .layout import add_text_search, text_search_column

        config = validate_ts_config(config or self.text_search_config)
        with (
            database_errors(self.db.dsn, f"add a full-text column to {self.layout.table}"),
            self._connection() as conn,
        ):
            add_text_search(conn, self.layout, config)
            column, found = text_search_column(conn, self.layout)
        self.layout = replace(self.layout, tsv_column=column, ts_config=found)

    # -------------------------------------------------------------- stores
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

    # -------------------------------------------------------------- querying
    def _check_request(
        self,
        top_k: Any,
        filters: Filters,
        *,
        name: str = "top_k",
        search: str | None = None,
        rrf_k: float | None = None,
        vector_weight: float | None = None,
        text_weight: float | None = None,
        candidates: int | None = None,
    ) -> tuple[list[Condition], str, tuple[float, float, float], int]:
        _check_top_k(top_k, name)
        conditions = to_conditions(filters)
        mode = check_search(self.search if search is None else search)
        fusion = _check_fusion(
            self.rrf_k if rrf_k is None else rrf_k,
            self.vector_weight if vector_weight is None else vector_weight,
            self.text_weight if text_weight is None else text_weight,
        )
        if candidates is None:
            depth = min(max(top_k, 50), MAX_TOP_K)
        else:
            _check_top_k(candidates, "candidates")
            depth = max(candidates, top_k)
        if mode != "vector" and self.layout.tsv_column is None:
            self._refresh_text_search()  # another process may have added it meanwhile
        if mode != "vector" and self.layout.tsv_column is None:
            raise ValueError(
                f"search={mode!r} needs a full-text column, and table {self.layout.table} has "
                "none (it was ingested before tokrag added one, or by another tool). Add it "
                f"with `tokrag ingest PATH... --table {self.table} --upgrade` or "
                "PostgresKnowledgeBase.add_text_search() (rewrites the table once), or use "
                "search='vector'."
            )
        return conditions, mode, fusion, depth

    def retrieve(
        self,
        query: str,
        top_k: int = 4,
        filters: Filters = None,
        *,
        search: SearchMode | None = None,
        rrf_k: float | None = None,
        vector_weight: float | None = None,
        text_weight: float | None = None,
        candidates: int | None = None,
    ) -> list[RetrievedChunk]:
        """The ``top_k`` best chunks for ``query`` that match ``filters``, best first.

        Args:
            query: The question.
            top_k: Chunks to return (1..1000).
            filters: See :func:`~.search.to_conditions`: ``{"file_name": "a.md"}``,
                ``{"year": {"$gte": 2020}}``, ``["format=md", "year>=2020"]``...
            search: ``"vector"`` (cosine similarity, the score), ``"text"`` (full text,
                ``ts_rank``) or ``"hybrid"`` (reciprocal rank fusion of both); default: the
                knowledge base's ``search``.
            rrf_k / vector_weight / text_weight: Hybrid fusion settings (default: the
                knowledge base's).
            candidates: Rows each ranking contributes to hybrid fusion (default
                ``max(top_k, 50)``).

        Raises:
            ValueError: Empty query, ``top_k`` outside 1..1000, a bad filter or search mode,
                text or hybrid search on a table without a full-text column, or a number
                given as the value of a key whose stored values are text.
            PostgresQueryError: The database refused the query (e.g. no SELECT privilege).
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("The query is empty; pass a question to retrieve chunks for.")
        conditions, mode, (k, wv, wt), depth = self._check_request(
            top_k,
            filters,
            search=search,
            rrf_k=rrf_k,
            vector_weight=vector_weight,
            text_weight=text_weight,
            candidates=candidates,
        )
        query = query.strip()
        embedding = None
        if mode in ("vector", "hybrid"):
            import numpy as np

            embedding = np.asarray(self.embedder.embed_query(query), dtype=np.float32)
        statement, params = search_statement(
            self.layout,
            mode,
            conditions,
            top_k=top_k,
            candidates=depth,
            rrf_k=k,
            vector_weight=wv,
            text_weight=wt,
            embedding=embedding,
            query=query,
            ts_config=self.layout.ts_config or self.text_search_config,
        )
        try:
            with self._connection() as conn, conn.transaction():
                conn.execute(
                    "SELECT set_config('hnsw.ef_search', %s, true)",
                    (str(min(max(self.ef_search, top_k, depth if mode == "hybrid" else 0), MAX_TOP_K)),),
                )
                rows = conn.execute(statement, params).fetchall()
        except Exception as exc:
            if not is_driver_error(exc):
                raise
            numeric = sorted({c.key for c in conditions if c.numeric})
            if numeric and sqlstate_of(exc) == "22P02":  # invalid_text_representation
                raise ValueError(
                    f"Filter {', '.join(numeric)}: a number was given, but the stored values "
                    "of that key are not all numbers; pass the value as a string (e.g. "
                    f"{{{numeric[0]!r}: '3'}})."
                ) from None
            raise query_error(exc, self.db.dsn, f"search table {self.layout.table}") from None
        return [_chunk(node_id, text, meta, score) for node_id, text, meta, score in rows]

    async def aretrieve(self, query: str, top_k: int = 4, filters: Filters = None, **search_options: Any) -> list[RetrievedChunk]:
        """:meth:`retrieve` without blocking the event loop: it runs in a worker thread on a
        connection of the same pool (the query embedding is computed there too)."""
        return await asyncio.to_thread(self.retrieve, query, top_k, filters, **search_options)

    def count(self, source: str | Path | None = None) -> int:
        """Chunks in the table (for one source path when given)."""
        from psycopg import sql

        lay = self.layout
        table = sql.Identifier(lay.table)
        with (
            database_errors(self.db.dsn, f"count rows of {lay.table}"),
            self._connection() as conn,
        ):
            if source is None:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE {}").format(table, lay.where_sql)
                ).fetchone()
            else:
                row = conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE {} AND {} = %s").format(
                        table, lay.where_sql, sql.SQL(lay.source_expr)
                    ),
                    (str(Path(source).resolve()),),
                ).fetchone()
        return int(row[0]) if row else 0

    def answer(
        self,
        question: str,
        lm: Any,
        *,
        policy: str = "tokrag",
        top_k: int = 4,
        filters: Filters = None,
        search: SearchMode | None = None,
        **options: Any,
    ) -> PostgresAnswer:
        """Retrieve (with ``search``), then decode with the core
        :func:`~tokrag_integrations.generate`."""
        from ..api import generate

        chunks = self.retrieve(question, top_k=top_k, filters=filters, search=search)
        result = generate(lm, question, [c.to_passage() for c in chunks], policy=policy, **options)
        return PostgresAnswer(result=result, chunks=chunks)

    async def aanswer(
        self,
        question: str,
        lm: Any,
        *,
        policy: str = "tokrag",
        top_k: int = 4,
        filters: Filters = None,
        search: SearchMode | None = None,
        **options: Any,
    ) -> PostgresAnswer:
        """:meth:`answer` without blocking the event loop: retrieval and decoding run in a
        worker thread (the model never runs on the loop)."""
        return await asyncio.to_thread(
            self.answer,
            question,
            lm,
            policy=policy,
            top_k=top_k,
            filters=filters,
            search=search,
            **options,
        )

    def close(self) -> None:
        """Release the framework stores' engines (the shared psycopg pool stays open for other
        users of the database until the process exits; see :func:`.pool.close_pools`)."""
        with self._lock:
            if self._li_store is not None:
                close_llamaindex_store(self._li_store)
                self._li_store = None
            if self._lc_engine is not None:
                self._lc_engine._run_as_sync(self._lc_engine._pool.dispose())
                self._lc_engine = None
                self._lc_store = None

    def __enter__(self) -> PostgresKnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_fusion(rrf_k: Any, vector_weight: Any, text_weight: Any) -> tuple[float, float, float]:
    for name, value in (("rrf_k", rrf_k), ("vector_weight", vector_weight), ("text_weight", text_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value == value:
            raise ValueError(f"{name} must be a number, got {value!r}.")
        if value < 0 or (name == "rrf_k" and value == 0) or value == float("inf"):
            raise ValueError(f"{name} must be {'positive' if name == 'rrf_k' else '>= 0'} and finite, got {value!r}.")
    if vector_weight == 0 and text_weight == 0:
        raise ValueError("vector_weight and text_weight are both 0; give at least one a weight.")
    return float(rrf_k), float(vector_weight), float(text_weight)


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


_KBS: dict[tuple[Any, ...], PostgresKnowledgeBase] = {}
_KBS_LOCK = threading.Lock()


def _knowledge_base(
    dsn: str | None, table: str, embed_model: Any, data_dir: Any
) -> PostgresKnowledgeBase:
    key = (dsn, validate_table_name(table), str(embed_model), str(data_dir))
    with _KBS_LOCK:
        kb = _KBS.get(key)
        if kb is None:
            kb = PostgresKnowledgeBase(dsn, table, embed_model=embed_model, data_dir=data_dir)
            _KBS[key] = kb
        return kb


def answer_from_postgres(
    question: str,
    dsn: str | None = None,
    table: str = DEFAULT_TABLE,
    filters: Filters = None,
    policy: str = "tokrag",
    top_k: int = 4,
    model: Any = None,
    *,
    embed_model: str | Path | None = None,
    data_dir: str | Path | None = None,
    search: SearchMode | None = None,
    **options: Any,
) -> PostgresAnswer:
    """Answer ``question`` from an ingested table (``tokrag ask --store postgres``).

    Args:
        question: The question.
        dsn: Connection URL; ``None`` uses ``$TOKRAG_PG_DSN`` or the embedded server.
        table: Logical table name given to ``tokrag ingest``.
        filters: ``{"file_name": "guide.md"}`` or ``["file_name=guide.md"]`` (repeat a key
            for "any of"); passed to the store as bound parameters.
        policy: Decoding policy (``"tokrag"``, ``"rag"``, ``"llm"``...).
        top_k: Chunks to retrieve.
        model: A :class:`~tokrag_integrations.LoadedModel`, or a name/path for
            :func:`~tokrag_integrations.load_model` (``None``: the packaged default).
        embed_model: The ``--embed-model`` used at ingest, if any.
        data_dir: Data folder of the embedded server.
        search: ``"vector"`` (default), ``"text"`` or ``"hybrid"`` (see
            :meth:`PostgresKnowledgeBase.retrieve`).
        **options: Passed to :func:`~tokrag_integrations.generate` (``max_new_tokens``,
            ``stop``, policy options...).

    Returns:
        :class:`PostgresAnswer` (``result, chunks = answer_from_postgres(...)`` works too).
    """
    from ..models import LoadedModel, load_model

    lm = model if isinstance(model, LoadedModel) else load_model(model or "default")
    kb = _knowledge_base(dsn, table, embed_model, data_dir)
    return kb.answer(
        question, lm, policy=policy, top_k=top_k, filters=filters, search=search, **options
    )
