"""LangChain adapters for Tok-RAG: a chat model, a retrieval chain, a documents chain, a
folder retriever, a local embedding and a gated router (examples: README.md,
docs/integrations.md). They translate LangChain types into the core API and back.

    >>> from tokrag_integrations.langchain import ChatTokRAG, FolderRetriever, create_tokrag_chain
    >>> retriever = FolderRetriever(paths=["my_docs/"])   # or any store's .as_retriever()
    >>> chain = create_tokrag_chain(retriever, ChatTokRAG(model="default", max_tokens=16))
    >>> out = chain.invoke("Who founded Quillfeather Aerospace?")
    >>> sorted(out)
    ['answer', 'citations', 'context', 'input', 'retrieval_empty', 'sources', 'trace', 'warnings']

Importing :mod:`tokrag_integrations` never imports LangChain; only this subpackage does.
"""

from __future__ import annotations

try:
    from ..retrieval.langchain_embeddings import local_embeddings
    from .chains import TokRAGChain, create_tokrag_chain, create_tokrag_documents_chain
    from .chat_models import ChatTokRAG
    from .gated_router import gated_router
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
