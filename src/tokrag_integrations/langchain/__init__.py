"""LangChain adapters for Tok-RAG: a chat model, a retrieval chain, a documents chain, a
folder retriever, a local embedding and a gated router. They translate LangChain types into
the core API and back; no decoding logic lives here.

    >>> from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain, local_embeddings
    >>> from langchain_core.vectorstores import InMemoryVectorStore
    >>> store = InMemoryVectorStore.from_documents(docs, local_embeddings())
    >>> chain = create_tokrag_chain(store.as_retriever(), ChatTokRAG(model="default"))
    >>> out = chain.invoke("Who founded Quillfeather Aerospace?")
    >>> out["answer"], out["trace"]["counts"]
    >>> # Your create_stuff_documents_chain prompt ({context}, {input}), decoded with Tok-RAG:
    >>> chain = create_tokrag_chain(store.as_retriever(), ChatTokRAG(model="default"), prompt=prompt)

Importing :mod:`tokrag_integrations` never imports LangChain; only this subpackage does.
"""

from __future__ import annotations

try:
    from .chains import TokRAGChain, create_tokrag_chain, create_tokrag_documents_chain
    from .chat_models import ChatTokRAG
    from .gated_router import gated_router
    from .local_embeddings import local_embeddings
    from .retrievers import FolderRetriever
except ModuleNotFoundError as e:  # pragma: no cover - depends on the environment
    if not (e.name or "").startswith("langchain"):
        raise
    raise ImportError(
        "tokrag_integrations.langchain needs LangChain, which is not installed. "
        "Install it with: pip install 'tokrag-integrations[langchain]'"
    ) from e

__all__ = [
    "ChatTokRAG",
    "FolderRetriever",
    "TokRAGChain",
    "create_tokrag_chain",
    "create_tokrag_documents_chain",
    "gated_router",
    "local_embeddings",
]
