"""LlamaIndex and LangChain retrievers over :meth:`PostgresKnowledgeBase.retrieve`.

They translate types and nothing else: the search, the filters and the pool are the
knowledge base's. Both frameworks' async entry points (``aretrieve``, ``ainvoke``) call
:meth:`PostgresKnowledgeBase.aretrieve`. The classes are built on first use, so importing
this module imports neither framework.
"""

from __future__ import annotations

from typing import Any

__all__ = ["langchain_retriever", "llamaindex_retriever"]

_CLASSES: dict[str, type] = {}


def _llamaindex_class() -> type:
    if "llamaindex" in _CLASSES:
        return _CLASSES["llamaindex"]
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
                        metadata=dict(c.metadata),
                        excluded_llm_metadata_keys=list(c.metadata),
                        excluded_embed_metadata_keys=list(c.metadata),
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

    _CLASSES["llamaindex"] = PostgresRetriever
    return PostgresRetriever


def _langchain_class() -> type:
    if "langchain" in _CLASSES:
        return _CLASSES["langchain"]
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
        """Metadata filters (see :func:`~tokrag_integrations.postgres.search.to_conditions`)."""
        options: dict[str, Any] = {}
        """:meth:`PostgresKnowledgeBase.retrieve` keyword arguments (``search``...)."""

        @staticmethod
        def _documents(chunks: list[Any]) -> list[Document]:
            return [
                Document(page_content=c.text, metadata=dict(c.metadata), id=c.node_id or None)
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

    _CLASSES["langchain"] = PostgresRetriever
    return PostgresRetriever


def llamaindex_retriever(kb: Any, *, top_k: int, filters: Any = None, **options: Any) -> Any:
    """A LlamaIndex ``BaseRetriever`` returning ``NodeWithScore`` (score as ``retrieve``'s)."""
    return _llamaindex_class()(kb, top_k, filters, options)


def langchain_retriever(kb: Any, *, k: int, filters: Any = None, **options: Any) -> Any:
    """A LangChain ``BaseRetriever`` returning ``Document`` objects (metadata as ``retrieve``'s)."""
    return _langchain_class()(kb=kb, k=k, filters=filters, options=options)
