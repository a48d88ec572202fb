"""Reading the ingested table: LlamaIndex and LangChain retrievers, and answers from it.

One table serves both frameworks. LlamaIndex reads it through its ``PGVectorStore`` (the
schema it created); LangChain reads the *same* table through ``langchain-postgres``'s
``PGEngine`` / ``PGVectorStore`` with custom column names::

    table_name="data_<table>", id_column="node_id", content_column="text",
    embedding_column="embedding", metadata_json_column="metadata_"

(``PGVectorStore.create`` checks that those columns exist and have the right types; the
content is ``character varying`` and the metadata JSONB, both accepted). LangChain documents
therefore carry LlamaIndex's bookkeeping keys (``_node_content``, ``ref_doc_id``...) next
to ours (``source``, ``chunk``, ``file_name``...). Tables written with
``tokrag ingest --target langchain`` use LangChain's default columns instead and are read
by LangChain only.

**Metadata filters are parameterised.** ``PGVectorStore`` (llama-index-vector-stores-postgres
0.9) formats filter keys *and values* into SQL text, so a value such as ``x' OR '1'='1``
would be injected. :func:`make_llamaindex_store` returns a subclass whose
``_build_filter_clause`` builds SQLAlchemy expressions with bound parameters instead, and
every filter key is checked by :func:`validate_filter_key` (ASCII identifiers only) before
it reaches either framework. Values may contain anything (quotes, semicolons, unicode).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..booleans import require_bool
from .embeddings import Embedder, load_embedder
from .layout import TableLayout, Target, check_layout
from .server import (
    DEFAULT_TABLE,
    ResolvedDatabase,
    connect,
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

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# LlamaIndex's bookkeeping keys, dropped from the metadata we hand to prompts and users.
_INTERNAL_KEYS = frozenset({"_node_content", "_node_type", "doc_id", "document_id", "ref_doc_id"})

Filters = Mapping[str, Any] | Sequence[str] | None


# ============================================================================ filters
def validate_filter_key(key: str) -> str:
    """``key`` if it is a plain ASCII identifier, else a ``ValueError`` saying so."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"Invalid filter key {key!r}: use ASCII letters, digits and underscores, starting "
            "with a letter or underscore (e.g. file_name, source, chunk)."
        )
    return key


def parse_filter_args(args: Iterable[str]) -> dict[str, list[str]]:
    """``["file_name=a.md", "file_name=b.md", "format=md"]`` -> ``{key: [values]}``.

    Repeating a key means "any of these values"; different keys must all match.
    """
    out: dict[str, list[str]] = {}
    for arg in args:
        key, sep, value = str(arg).partition("=")
        if not sep:
            raise ValueError(
                f"--filter {arg!r} is not key=value (e.g. --filter file_name=guide.md)."
            )
        out.setdefault(validate_filter_key(key.strip()), []).append(value)
    return out


def normalize_filters(filters: Filters) -> dict[str, list[Any]]:
    """Filters as ``{key: [allowed values]}`` (key validated); accepts a mapping or key=value strings."""
    if not filters:
        return {}
    if isinstance(filters, Mapping):
        out: dict[str, list[Any]] = {}
        for key, value in filters.items():
            values = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
            if not values:
                raise ValueError(f"Filter {key!r} has no values.")
            for v in values:
                if not isinstance(v, (str, int, float)) or isinstance(v, bool):
                    raise ValueError(
                        f"Filter {key!r}: values must be strings or numbers, got {type(v).__name__}."
                    )
            out[validate_filter_key(key)] = values
        return out
    if isinstance(filters, str):
        filters = [filters]
    return dict(parse_filter_args(filters))


def _llamaindex_filters(filters: dict[str, list[Any]]) -> Any:
    from llama_index.core.vector_stores.types import FilterOperator, MetadataFilter, MetadataFilters

    if not filters:
        return None
    items = [
        MetadataFilter(key=k, value=v[0], operator=FilterOperator.EQ)
        if len(v) == 1
        else MetadataFilter(key=k, value=list(v), operator=FilterOperator.IN)
        for k, v in filters.items()
    ]
    return MetadataFilters(filters=items)


def _langchain_filter(filters: dict[str, list[Any]]) -> dict[str, Any] | None:
    if not filters:
        return None
    parts = [{k: v[0]} if len(v) == 1 else {k: {"$in": list(v)}} for k, v in filters.items()]
    return parts[0] if len(parts) == 1 else {"$and": parts}


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
            raise ValueError(
                f"Filter operator {op.value!r} is not supported here; use ==, !=, <, >, <=, >=, "
                "in, nin, text_match or is_empty."
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
) -> Any:
    """A LlamaIndex ``PGVectorStore`` (safe-filter subclass) over ``layout``'s table.

    With ``setup=True`` the store creates the extension, table, ``ref_doc_id`` index and the
    HNSW index (``m=16, ef_construction=64``, cosine) on first use; errors are raised, not
    logged and swallowed.
    """
    require_bool(setup, "setup")
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
    """One retrieved chunk with its cosine similarity (higher is better)."""

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
    message when the database is unreachable. The layout (LlamaIndex or LangChain) is
    detected from the tables present.
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
    ) -> None:
        self.db = resolve_dsn(dsn, data_dir=data_dir)
        self.table = validate_table_name(table)
        self.ef_search = ef_search
        with database_errors(self.db.dsn, f"open table {self.table}"):
            self.layout = self._detect_layout(target)
            self.embedder: Embedder = load_embedder(embed_model)
            self._check_embedder()
        self._lock = threading.Lock()
        self._li_store: Any = None
        self._lc_engine: Any = None
        self._lc_store: Any = None

    def __repr__(self) -> str:
        return f"PostgresKnowledgeBase(table={self.layout.table!r}, db={self.db.masked!r})"

    # -------------------------------------------------------------- checks
    def _detect_layout(self, target: Target | None) -> TableLayout:
        candidates = [TableLayout.for_target(self.table, t) for t in (target,) if t] or [
            TableLayout.for_target(self.table, t)
            for t in ("llamaindex", "langchain")
            if t == "llamaindex" or not is_reserved_word(self.table)  # never a langchain table
        ]
        with connect(self.db.dsn, autocommit=True) as conn:
            for layout in candidates:
                # A table of that name without our columns is an error, never read.
                if check_layout(conn, layout, self.db.masked):
                    return layout
        names = " or ".join(c.table for c in candidates)
        raise LookupError(
            f"No ingested table {names} at {self.db.masked}. Run `tokrag ingest PATH "
            f"--table {self.table}` first (with the same --dsn)."
        )

    def _check_embedder(self) -> None:
        m = self.layout.metadata_column
        with connect(self.db.dsn, autocommit=True) as conn:
            row = conn.execute(
                f"SELECT {m}->>'embed_model' FROM {self.layout.table} LIMIT 1"
            ).fetchone()
        if row and row[0] and row[0] != self.embedder.name:
            raise ValueError(
                f"Table {self.layout.table} was embedded with {row[0]!r}, but the query embedder "
                f"is {self.embedder.name!r}; pass the same --embed-model as at ingest."
            )

    # -------------------------------------------------------------- stores
    def llamaindex_store(self) -> Any:
        """The LlamaIndex ``PGVectorStore`` over the table (created once, shared)."""
        with self._lock:
            if self._li_store is None:
                self._li_store = make_llamaindex_store(
                    self.db, self.layout, self.embedder.dim, ef_search=self.ef_search
                )
            return self._li_store

    def llamaindex_retriever(self, top_k: int = 4, filters: Filters = None) -> Any:
        """A LlamaIndex ``VectorIndexRetriever`` over the table, with metadata filters."""
        from llama_index.core import VectorStoreIndex

        _check_top_k(top_k)
        index = VectorStoreIndex.from_vector_store(
            self.llamaindex_store(), embed_model=self.embedder.llamaindex()
        )
        return index.as_retriever(
            similarity_top_k=top_k,
            filters=_llamaindex_filters(normalize_filters(filters)),
            vector_store_kwargs={"hnsw_ef_search": max(self.ef_search, top_k)},
        )

    def langchain_store(self) -> Any:
        """A ``langchain_postgres.PGVectorStore`` over the same table (custom column names)."""
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

    def langchain_retriever(self, k: int = 4, filters: Filters = None) -> Any:
        """A LangChain retriever (``VectorStoreRetriever``) over the table, with filters."""
        _check_top_k(k, "k")
        search_kwargs: dict[str, Any] = {"k": k}
        flt = _langchain_filter(normalize_filters(filters))
        if flt:
            search_kwargs["filter"] = flt
        return self.langchain_store().as_retriever(search_kwargs=search_kwargs)

    # -------------------------------------------------------------- querying
    def retrieve(self, query: str, top_k: int = 4, filters: Filters = None) -> list[RetrievedChunk]:
        """The ``top_k`` chunks most similar to ``query`` that match ``filters``, best first.

        Raises:
            ValueError: Empty query, ``top_k`` outside 1..1000, a bad filter, or a number
                given as the value of a key whose stored values are text.
            PostgresQueryError: The database refused the query (e.g. no SELECT privilege).
        """
        if not isinstance(query, str) or not query.strip():
            raise ValueError("The query is empty; pass a question to retrieve chunks for.")
        _check_top_k(top_k)
        flt = normalize_filters(filters)
        try:
            return self._retrieve(query, top_k, flt)
        except Exception as exc:
            if not is_driver_error(exc):
                raise
            numeric = sorted(
                k for k, vs in flt.items() if any(not isinstance(v, str) for v in vs)
            )
            if numeric and sqlstate_of(exc) == "22P02":  # invalid_text_representation
                raise ValueError(
                    f"Filter {', '.join(numeric)}: a number was given, but the stored values "
                    "of that key are not all numbers; pass the value as a string (e.g. "
                    f"{{{numeric[0]!r}: '3'}})."
                ) from None
            raise query_error(exc, self.db.dsn, f"search table {self.layout.table}") from None

    def _retrieve(
        self, query: str, top_k: int, flt: dict[str, list[Any]]
    ) -> list[RetrievedChunk]:
        if self.layout.target == "langchain":
            docs = self.langchain_store().similarity_search_with_score(
                query, k=top_k, filter=_langchain_filter(flt)
            )
            return [
                RetrievedChunk(
                    text=d.page_content,
                    score=1.0 - float(dist),
                    source=str(d.metadata.get("source", "")),
                    chunk=int(d.metadata.get("chunk", 0)),
                    metadata=_clean_metadata(d.metadata),
                    node_id=str(d.id or ""),
                )
                for d, dist in docs
            ]
        from llama_index.core.vector_stores.types import VectorStoreQuery

        result = self.llamaindex_store().query(
            VectorStoreQuery(
                query_embedding=self.embedder.embed_query(query.strip()),
                similarity_top_k=top_k,
                filters=_llamaindex_filters(flt),
            ),
            hnsw_ef_search=max(self.ef_search, top_k),
        )
        chunks = []
        for node, sim in zip(result.nodes or [], result.similarities or [], strict=False):
            meta = _clean_metadata(node.metadata)
            chunks.append(
                RetrievedChunk(
                    text=node.get_content(),
                    score=float(sim),
                    source=str(meta.get("source", "")),
                    chunk=int(meta.get("chunk", 0)),
                    metadata=meta,
                    node_id=node.node_id,
                )
            )
        return chunks

    def count(self, source: str | Path | None = None) -> int:
        """Chunks in the table (for one source path when given)."""
        lay = self.layout
        with (
            database_errors(self.db.dsn, f"count rows of {lay.table}"),
            connect(self.db.dsn, autocommit=True) as conn,
        ):
            if source is None:
                row = conn.execute(f"SELECT count(*) FROM {lay.table}").fetchone()
            else:
                row = conn.execute(
                    f"SELECT count(*) FROM {lay.table} WHERE {lay.source_expr} = %s",
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
        **options: Any,
    ) -> PostgresAnswer:
        """Retrieve, then decode with the core :func:`~tokrag_integrations.generate`."""
        from ..api import generate

        chunks = self.retrieve(question, top_k=top_k, filters=filters)
        result = generate(lm, question, [c.to_passage() for c in chunks], policy=policy, **options)
        return PostgresAnswer(result=result, chunks=chunks)

    def close(self) -> None:
        """Release connection pools (the embedded server stops when the process exits)."""
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
        **options: Passed to :func:`~tokrag_integrations.generate` (``max_new_tokens``,
            ``stop``, policy options...).

    Returns:
        :class:`PostgresAnswer` (``result, chunks = answer_from_postgres(...)`` works too).
    """
    from ..models import LoadedModel, load_model

    lm = model if isinstance(model, LoadedModel) else load_model(model or "default")
    kb = _knowledge_base(dsn, table, embed_model, data_dir)
    return kb.answer(question, lm, policy=policy, top_k=top_k, filters=filters, **options)
