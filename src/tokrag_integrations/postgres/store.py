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

The framework stores and retrievers over the same table are in :mod:`.framework_stores`.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from .embeddings import Embedder, load_embedder
from .framework_stores import (  # noqa: F401 - re-exported: this was their module
    FrameworkStores,
    _safe_store_class,
    _start_again_before_connecting,
    close_llamaindex_store,
    make_llamaindex_store,
)
from .layout import TableLayout, Target, detect_layout
from .results import (  # noqa: F401 - re-exported: this was their module
    _INTERNAL_KEYS,
    PostgresAnswer,
    RetrievedChunk,
    _chunk,
    _clean_metadata,
)
from .search import (  # noqa: F401 - MAX_TOP_K, Filters re-exported
    MAX_TOP_K,
    Condition,
    Filters,
    SearchMode,
    _check_fusion,
    _check_top_k,
    check_search,
    check_text,
    parse_filter_args,
    search_statement,
    to_conditions,
    validate_filter_key,
    validate_ts_config,
)
from .server import (
    DEFAULT_TABLE,
    database_errors,
    is_driver_error,
    query_error,
    resolve_dsn,
    sqlstate_of,
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





# ============================================================================ filters
def normalize_filters(filters: Filters) -> list[Condition]:
    """Filters as a list of :class:`~.search.Condition` (keys validated, values checked);
    see :func:`~.search.to_conditions` for the accepted forms and operators."""
    return to_conditions(filters)


# ============================================================================ knowledge base
class PostgresKnowledgeBase(FrameworkStores):
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
        with self._connection() as conn:
            return detect_layout(conn, self.table, self.db.masked, target, collection)

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
                :class:`~.errors.SearchInputError` (a ``ValueError``, naming the field):
                a NUL character or a lone surrogate in the query or a filter value, a
                filter number that is NaN, infinite or outside ``bigint``.
            PostgresQueryError: The database refused the query (e.g. no SELECT privilege).
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("The query is empty; pass a question to retrieve chunks for.")
        check_text(query, "query", "the query")
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
        """Chunks in the table (for one source path when given).

        Raises:
            ValueError: ``source`` holds a NUL character or a lone surrogate
                (:class:`~.errors.SearchInputError`).
        """
        from psycopg import sql

        if source is not None:
            check_text(str(source), "source", "the source")

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
        from ..batching import generate

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
        self._close_stores()

    def __enter__(self) -> PostgresKnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            ``stop``, ``policy_options={...}``, ``speed=``...).

    Returns:
        :class:`PostgresAnswer` (``result, chunks = answer_from_postgres(...)`` works too).
    """
    from ..models import LoadedModel, load_model

    lm = model if isinstance(model, LoadedModel) else load_model(model or "default")
    kb = _knowledge_base(dsn, table, embed_model, data_dir)
    return kb.answer(
        question, lm, policy=policy, top_k=top_k, filters=filters, search=search, **options
    )
