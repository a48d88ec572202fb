"""Reading an ingested table: :class:`PostgresKnowledgeBase` (searches, both frameworks'
retrievers and stores, answers) and :func:`answer_from_postgres`."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePath
from typing import Any

from ..retrieval.embedder import Embedder, load_embedder
from ..retrieval.fusion import CANDIDATES, RRF_K, check_fusion
from .connection import pool_settings, pooled, resolve_dsn, shared_pool
from .dsn import database_errors, is_driver_error, query_error, sqlstate_of
from .frameworks import (
    close_llamaindex_store,
    langchain_retriever,
    llamaindex_retriever,
    make_langchain_store,
    make_llamaindex_store,
)
from .layout import (
    DEFAULT_TABLE,
    Target,
    add_text_search,
    check_embedder,
    detect_layout,
    text_search_column,
    validate_table_name,
)
from .search import (
    MAX_TOP_K,
    Filters,
    SearchMode,
    check_search,
    check_text,
    check_top_k,
    fuse_rows,
    search_statement,
    to_conditions,
    validate_ts_config,
)

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

    @property
    def passage_metadata(self) -> dict[str, Any]:
        """The chunk's metadata with its ``source`` and row id (``node_id``): what a passage
        made of it carries, so that its citations name both."""
        return {**self.metadata, "source": self.source, "node_id": self.node_id}

    def to_passage(self) -> Any:
        """As a core :class:`~tokrag_integrations.Passage` (metadata: :attr:`passage_metadata`)."""
        from ..prompts import Passage

        return Passage(self.text, score=self.score, metadata=self.passage_metadata)


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
    """``source`` relative to the folder ``root`` (absolute and resolved, as ingest stores
    sources), or its file name alone when not under it: for clients that should not learn
    the server's folders."""
    path = PurePath(os.path.normpath(source))  # "docs/../etc" is not under "docs"
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _chunk(node_id: str, text: str, meta: Any, score: Any) -> RetrievedChunk:
    if isinstance(meta, str):  # a json column read as text
        meta = json.loads(meta)
    meta = meta if isinstance(meta, dict) else {}
    source = meta.get("source") or meta.get("ref_doc_id") or ""
    clean = {k: v for k, v in meta.items() if k not in _INTERNAL_KEYS}
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


# ============================================================================ knowledge base
class PostgresKnowledgeBase:
    """An ingested table plus the embedder it was built with; thread-safe for querying.

    Connects at construction (fails fast) and detects the layout (:mod:`.layout`).

    Args:
        dsn: Connection URL; ``None`` uses ``$TOKRAG_PG_DSN`` or the embedded server.
        table: Logical table name given to ``tokrag ingest``.
        embed_model: The ``--embed-model`` used at ingest, if any.
        data_dir: Data folder of the embedded server.
        target: Force the ``"llamaindex"`` or ``"langchain"`` layout instead of detecting it.
        ef_search: HNSW ``ef_search`` (raised to the number of rows asked for).
        search: Default mode of :meth:`retrieve`: ``"vector"``, ``"text"`` or ``"hybrid"``.
        text_search_config: For :meth:`add_text_search`, and for queries when the table's
            full-text column does not say which configuration it was built with.
        rrf_k / vector_weight / text_weight: Default hybrid fusion settings.
        pool_size / pool_timeout: The process's pool for this database (the first user
            decides; ``$TOKRAG_PG_POOL_SIZE`` or 10, ``$TOKRAG_PG_POOL_TIMEOUT`` or 30 s).
        collection: Read this collection of the older langchain-postgres ``PGVector``.
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
        rrf_k: float = RRF_K,
        vector_weight: float = 1.0,
        text_weight: float = 1.0,
        pool_size: int | None = None,
        pool_timeout: float | None = None,
        collection: str | None = None,
    ) -> None:
        self.search = check_search(search)
        self.text_search_config = validate_ts_config(text_search_config)
        self.rrf_k, self.vector_weight, self.text_weight = check_fusion(
            rrf_k, vector_weight, text_weight
        )
        if collection is not None and (not isinstance(collection, str) or not collection):
            raise ValueError(f"collection must be a non-empty string, got {collection!r}.")
        self.pool_size, self.pool_timeout = pool_settings(pool_size, pool_timeout)
        self.db = resolve_dsn(dsn, data_dir=data_dir)
        self.table = validate_table_name(table)
        self.ef_search = ef_search
        with database_errors(self.db.dsn, f"open table {self.table}"):
            with self._connection() as conn:
                self.layout = detect_layout(conn, self.table, self.db.masked, target, collection)
            self.embedder: Embedder = load_embedder(embed_model)
            with self._connection() as conn:
                check_embedder(conn, self.layout, self.embedder)
        self._lock = threading.Lock()
        self._li_store: Any = None
        self._lc_store: Any = None

    def __repr__(self) -> str:
        return f"PostgresKnowledgeBase(table={self.layout.table!r}, db={self.db.masked!r})"

    def _connection(self) -> Any:
        shared_pool(self.db.dsn, self.pool_size, self.pool_timeout)
        return pooled(self.db.dsn)

    def _refresh_text_search(self, add: str | None = None) -> None:
        """Read the table's full-text column again (another process may have added it),
        after adding it with configuration ``add`` when given."""
        action = "add a full-text column to" if add else "open table"
        with (
            database_errors(self.db.dsn, f"{action} {self.layout.table}"),
            self._connection() as conn,
        ):
            if add:
                add_text_search(conn, self.layout, add)
            column, config = text_search_column(conn, self.layout)
        self.layout = replace(self.layout, tsv_column=column, ts_config=config)

    @property
    def has_text_search(self) -> bool:
        """Whether the table has a full-text column (needed by text and hybrid search)."""
        return self.layout.tsv_column is not None

    def add_text_search(self, config: str | None = None) -> None:
        """Add the generated full-text column and its GIN index to a table ingested before
        tokrag made one (rewrites the table; nothing when it has one).

        Raises:
            ValueError: The server has no such text search configuration.
        """
        self._refresh_text_search(add=validate_ts_config(config or self.text_search_config))

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
    ) -> dict[str, Any]:
        """The keyword arguments of :func:`~.search.search_statement` for one request."""
        check_top_k(top_k, name)
        conditions = to_conditions(filters)
        mode = check_search(self.search if search is None else search)
        rrf_k, vector_weight, text_weight = check_fusion(
            self.rrf_k if rrf_k is None else rrf_k,
            self.vector_weight if vector_weight is None else vector_weight,
            self.text_weight if text_weight is None else text_weight,
        )
        if candidates is None:
            candidates = min(max(top_k, CANDIDATES), MAX_TOP_K)
        else:
            check_top_k(candidates, "candidates")
            candidates = max(candidates, top_k)
        if mode != "vector" and self.layout.tsv_column is None:
            self._refresh_text_search()
        if mode != "vector" and self.layout.tsv_column is None:
            raise ValueError(
                f"search={mode!r} needs a full-text column, and table {self.layout.table} has "
                "none (it was ingested before tokrag added one, or by another tool). Add it "
                f"with `tokrag ingest PATH... --table {self.table} --upgrade` or "
                "PostgresKnowledgeBase.add_text_search() (rewrites the table once), or use "
                "search='vector'."
            )
        return dict(
            search=mode, conditions=conditions, top_k=top_k, candidates=candidates,
            rrf_k=rrf_k, vector_weight=vector_weight, text_weight=text_weight,
        )  # fmt: skip

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
            top_k: Chunks to return (1..1000).
            filters: See :func:`~.search.to_conditions`: ``{"file_name": "a.md"}``,
                ``{"year": {"$gte": 2020}}``, ``["format=md", "year>=2020"]``...
            search / rrf_k / vector_weight / text_weight: Default: the knowledge base's.
            candidates: Rows each ranking gives hybrid fusion (default ``max(top_k, 50)``).

        Raises:
            ValueError: Empty query, ``top_k`` outside 1..1000, a bad filter or search mode,
                text or hybrid search without a full-text column, a number for a key stored
                as text; :class:`~.search.SearchInputError` for inputs no query can carry.
            PostgresQueryError: The database refused the query (e.g. no SELECT privilege).
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("The query is empty; pass a question to retrieve chunks for.")
        check_text(query, "query", "the query")
        request = self._check_request(
            top_k, filters, search=search, rrf_k=rrf_k, vector_weight=vector_weight,
            text_weight=text_weight, candidates=candidates,
        )  # fmt: skip
        query, mode = query.strip(), request["search"]
        fusion = {key: request.pop(key) for key in ("rrf_k", "vector_weight", "text_weight")}
        embedding = None
        if mode != "text":
            import numpy as np

            embedding = np.asarray(self.embedder.embed_query(query), dtype=np.float32)
        statement, params = search_statement(
            self.layout,
            embedding=embedding,
            query=query,
            ts_config=self.layout.ts_config or self.text_search_config,
            **request,
        )
        depth = request["candidates"] if mode == "hybrid" else 0
        ef_search = min(max(self.ef_search, top_k, depth), MAX_TOP_K)
        try:
            with self._connection() as conn, conn.transaction():
                conn.execute("SELECT set_config('hnsw.ef_search', %s, true)", (str(ef_search),))
                rows = conn.execute(statement, params).fetchall()
        except Exception as exc:
            if not is_driver_error(exc):
                raise
            numeric = sorted({c.key for c in request["conditions"] if c.numeric})
            if numeric and sqlstate_of(exc) == "22P02":  # invalid_text_representation
                raise ValueError(
                    f"Filter {', '.join(numeric)}: a number was given, but the stored values "
                    "of that key are not all numbers; pass the value as a string (e.g. "
                    f"{{{numeric[0]!r}: '3'}})."
                ) from None
            raise query_error(exc, self.db.dsn, f"search table {self.layout.table}") from None
        if mode == "hybrid":
            rows = fuse_rows(rows, top_k=top_k, **fusion)
        return [_chunk(node_id, text, meta, score) for node_id, text, meta, score in rows]

    async def aretrieve(
        self, query: str, top_k: int = 4, filters: Filters = None, **search_options: Any
    ) -> list[RetrievedChunk]:
        """:meth:`retrieve` without blocking the event loop: it runs in a worker thread on a
        connection of the same pool (the query embedding is computed there too)."""
        return await asyncio.to_thread(self.retrieve, query, top_k, filters, **search_options)

    def count(self, source: str | Path | None = None) -> int:
        """Chunks in the table (for one source path when given)."""
        from psycopg import sql

        lay = self.layout
        query = sql.SQL("SELECT count(*) FROM {} WHERE {}").format(
            sql.Identifier(lay.table), lay.where_sql
        )
        params: tuple[str, ...] = ()
        if source is not None:
            query = sql.SQL("{} AND {} = %s").format(query, sql.SQL(lay.source_expr))
            params = (str(Path(check_text(str(source), "source", "the source")).resolve()),)
        with database_errors(self.db.dsn, f"count rows of {lay.table}"), self._connection() as conn:
            row = conn.execute(query, params).fetchone()
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
        from ..engine.scheduler import generate

        chunks = self.retrieve(question, top_k=top_k, filters=filters, search=search)
        result = generate(lm, question, [c.to_passage() for c in chunks], policy=policy, **options)
        return PostgresAnswer(result=result, chunks=chunks)

    async def aanswer(self, question: str, lm: Any, **options: Any) -> PostgresAnswer:
        """:meth:`answer` (same options) without blocking the event loop: retrieval and
        decoding run in a worker thread (the model never runs on the loop)."""
        return await asyncio.to_thread(self.answer, question, lm, **options)

    def llamaindex_store(self) -> Any:
        """LlamaIndex's own ``PGVectorStore`` over the table (created once; the retrievers
        do not use it)."""
        with self._lock:
            if self._li_store is None:
                self._li_store = make_llamaindex_store(
                    self.db, self.layout, self.embedder.dim, ef_search=self.ef_search,
                    # its own hybrid / sparse queries need the column in its table class
                    hybrid_search=self.layout.tsv_column is not None,
                    text_search_config=self.layout.ts_config or self.text_search_config,
                )  # fmt: skip
            return self._li_store

    def llamaindex_retriever(
        self, top_k: int = 4, filters: Filters = None, **search_options: Any
    ) -> Any:
        """A LlamaIndex ``BaseRetriever`` over :meth:`retrieve` (sync and async);
        ``search_options`` are its keyword arguments, checked here."""
        self._check_request(top_k, filters, **search_options)
        return llamaindex_retriever(self, top_k=top_k, filters=filters, **search_options)

    def langchain_store(self) -> Any:
        """LangChain's own ``langchain_postgres.PGVectorStore`` over the table (custom column
        names; the retrievers do not use it)."""
        with self._lock:
            if self._lc_store is None:
                self._lc_store = make_langchain_store(self.db, self.layout, self.embedder)
            return self._lc_store

    def langchain_retriever(
        self, k: int = 4, filters: Filters = None, **search_options: Any
    ) -> Any:
        """A LangChain ``BaseRetriever`` over the table (``invoke`` / ``ainvoke``), with filters;
        ``search_options`` as for :meth:`llamaindex_retriever`."""
        self._check_request(k, filters, name="k", **search_options)
        return langchain_retriever(self, k=k, filters=filters, **search_options)

    def close(self) -> None:
        """Release the framework stores' engines (the shared pool stays open for other users
        of the database until the process exits)."""
        with self._lock:
            if self._li_store is not None:
                close_llamaindex_store(self._li_store)
                self._li_store = None
            if self._lc_store is not None:
                engine = self._lc_store._engine
                engine._run_as_sync(engine._pool.dispose())
                self._lc_store = None

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

    ``dsn``, ``table``, ``embed_model``, ``data_dir``: as :class:`PostgresKnowledgeBase`
    takes them; ``filters``, ``top_k``, ``search``: as :meth:`~PostgresKnowledgeBase.retrieve`
    takes them; ``model``: a :class:`~tokrag_integrations.LoadedModel` or what
    :func:`~tokrag_integrations.load_model` takes (``None``: the packaged default);
    ``policy`` and ``**options`` go to :func:`~tokrag_integrations.generate`. Returns a
    :class:`PostgresAnswer` (``result, chunks = answer_from_postgres(...)`` works too).
    """
    from ..models import LoadedModel, load_model

    lm = model if isinstance(model, LoadedModel) else load_model(model or "default")
    kb = _knowledge_base(dsn, table, embed_model, data_dir)
    return kb.answer(
        question, lm, policy=policy, top_k=top_k, filters=filters, search=search, **options
    )
