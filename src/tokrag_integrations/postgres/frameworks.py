"""LlamaIndex's and LangChain's views of an ingested table: their own stores, and retrievers
over :meth:`PostgresKnowledgeBase.retrieve` that only translate types. Classes are built on
first use, so importing this module imports neither framework."""

from __future__ import annotations

import json
import logging
import operator
import re
import threading
from functools import cache
from typing import Any

from ..config import require_bool
from .connection import ResolvedDatabase, connect_timeout
from .dsn import sqlalchemy_url
from .embedded import start_again_if_stopped
from .search import validate_filter_key, validate_ts_config


@cache
def _safe_store_class() -> Any:
    """``PGVectorStore`` (llama-index-vector-stores-postgres 0.9 formats filter keys *and
    values* into SQL text) whose ``_build_filter_clause`` binds them as parameters."""
    import sqlalchemy
    from llama_index.core.vector_stores.types import FilterOperator
    from llama_index.vector_stores.postgres import PGVectorStore

    class SafeFilterPGVectorStore(PGVectorStore):
        """``PGVectorStore`` whose metadata filters are bound parameters, never SQL text."""

        def _initialize(self) -> None:
            # A setup error is raised (initialization_fail_on_error) and reported in one
            # sentence; PGVectorStore's warning with its whole SQL statement is dropped.
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

            compare = {
                FilterOperator.EQ: operator.eq,
                FilterOperator.NE: operator.ne,
                FilterOperator.GT: operator.gt,
                FilterOperator.LT: operator.lt,
                FilterOperator.GTE: operator.ge,
                FilterOperator.LTE: operator.le,
            }
            if op in compare:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    return compare[op](sqlalchemy.cast(field_, sqlalchemy.Float), float(value))
                return compare[op](field_, str(value))
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
                    return stored.op("@>")(
                        sqlalchemy.cast(sqlalchemy.literal(json.dumps(items)), JSONB)
                    )

                if op == FilterOperator.ANY:
                    return sqlalchemy.or_(*(holds([v]) for v in values))
                return holds(values)  # CONTAINS (one value) and ALL
            raise ValueError(
                f"Filter operator {op.value!r} is not supported here; use ==, !=, <, >, <=, >=, "
                "in, nin, contains, any, all, text_match or is_empty."
            )

    return SafeFilterPGVectorStore


def make_llamaindex_store(
    db: ResolvedDatabase,
    layout: Any,
    embed_dim: int,
    *,
    setup: bool = False,
    ef_search: int = 40,
    hybrid_search: bool = False,
    text_search_config: str = "english",
) -> Any:
    """A LlamaIndex ``PGVectorStore`` (safe-filter subclass) over ``layout``'s table; with
    ``setup=True`` it creates the table and its indexes (HNSW ``m=16, ef_construction=64``,
    cosine) on first use, with ``hybrid_search`` the ``text_search_tsv`` column too."""
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
    options = {"connect_args": {"connect_timeout": connect_timeout()}, "pool_pre_ping": True}
    # psycopg2 binds ``SET hnsw.ef_search = :value`` on the client (psycopg 3 cannot); the
    # async path formats the value into the SQL itself.
    engine = create_engine(sqlalchemy_url(db.dsn, "psycopg2"), **options)
    async_engine = create_async_engine(sqlalchemy_url(db.dsn, "psycopg"), **options)
    for each in (engine, async_engine):
        start_again_before_connecting(each, db.dsn)
    # The store uses the engines; the strings are only shown (repr, model_dump): no password.
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


def make_langchain_store(db: ResolvedDatabase, layout: Any, embedder: Any) -> Any:
    """LangChain's own ``PGVectorStore`` over ``layout``'s table (custom column names)."""
    if layout.target == "langchain_legacy":
        raise ValueError(
            f"Collection {layout.collection!r} is a legacy langchain-postgres PGVector "
            "collection; read it with langchain_postgres.PGVector(collection_name=...) or "
            "through langchain_retriever()."
        )
    from langchain_postgres import PGEngine, PGVectorStore

    from ..retrieval.langchain_embeddings import LocalEmbeddings

    engine = PGEngine.from_connection_string(
        sqlalchemy_url(db.dsn),
        connect_args={"connect_timeout": connect_timeout()},
        pool_pre_ping=True,
    )
    start_again_before_connecting(engine._pool, db.dsn)
    return PGVectorStore.create_sync(
        engine,
        embedding_service=LocalEmbeddings(embedder),
        table_name=layout.table,
        id_column=layout.id_column,
        content_column=layout.text_column,
        embedding_column=layout.embedding_column,
        metadata_json_column=layout.metadata_column,
    )


def start_again_before_connecting(engine: Any, dsn: str) -> None:
    """Before ``engine`` connects, start this process's embedded server again if it was
    stopped from outside (with ``pool_pre_ping``, stale connections are replaced)."""
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


@cache
def _llamaindex_class() -> type:
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

    class PostgresRetriever(BaseRetriever):
        """A LlamaIndex retriever over a :class:`PostgresKnowledgeBase` (vector, text or hybrid)."""

        def __init__(self, kb: Any, top_k: int, filters: Any, options: dict[str, Any]) -> None:
            super().__init__()
            self.kb = kb
            self.similarity_top_k = top_k
            self.filters = filters
            self.options = options

        @staticmethod
        def _nodes(chunks: list[Any]) -> list[NodeWithScore]:
            # Metadata stays out of what the LLM and embedder read, as in the nodes ingest
            # writes: a prompt holds the chunk's text only.
            return [
                NodeWithScore(
                    node=TextNode(
                        id_=c.node_id or None,
                        text=c.text,
                        metadata=c.passage_metadata,
                        excluded_llm_metadata_keys=list(c.passage_metadata),
                        excluded_embed_metadata_keys=list(c.passage_metadata),
                    ),
                    score=c.score,
                )
                for c in chunks
            ]

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return self._nodes(
                self.kb.retrieve(
                    query_bundle.query_str, self.similarity_top_k, self.filters, **self.options
                )
            )

        async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return self._nodes(
                await self.kb.aretrieve(
                    query_bundle.query_str, self.similarity_top_k, self.filters, **self.options
                )
            )

    return PostgresRetriever


@cache
def _langchain_class() -> type:
    from langchain_core.callbacks import (
        AsyncCallbackManagerForRetrieverRun,
        CallbackManagerForRetrieverRun,
    )
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    class PostgresRetriever(BaseRetriever):
        """A LangChain retriever over a :class:`PostgresKnowledgeBase` (vector, text or hybrid)."""

        kb: Any
        """The knowledge base."""
        k: int = 4
        """Documents to return."""
        filters: Any = None
        """Metadata filters (see :func:`~.search.to_conditions`)."""
        options: dict[str, Any] = {}
        """:meth:`PostgresKnowledgeBase.retrieve` keyword arguments (``search``...)."""

        @staticmethod
        def _documents(chunks: list[Any]) -> list[Document]:
            return [
                Document(page_content=c.text, metadata=c.passage_metadata, id=c.node_id or None)
                for c in chunks
            ]

        def _get_relevant_documents(
            self, query: str, *, run_manager: CallbackManagerForRetrieverRun
        ) -> list[Document]:
            return self._documents(self.kb.retrieve(query, self.k, self.filters, **self.options))

        async def _aget_relevant_documents(
            self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
        ) -> list[Document]:
            return self._documents(
                await self.kb.aretrieve(query, self.k, self.filters, **self.options)
            )

    return PostgresRetriever


def llamaindex_retriever(kb: Any, *, top_k: int, filters: Any = None, **options: Any) -> Any:
    """A LlamaIndex ``BaseRetriever`` returning ``NodeWithScore`` (score as ``retrieve``'s)."""
    return _llamaindex_class()(kb, top_k, filters, options)


def langchain_retriever(kb: Any, *, k: int, filters: Any = None, **options: Any) -> Any:
    """A LangChain ``BaseRetriever`` returning ``Document`` objects (metadata as ``retrieve``'s)."""
    return _langchain_class()(kb=kb, k=k, filters=filters, options=options)
