"""The one loaded MiniLM embedder (:func:`~tokrag_integrations.retrieval.embedder.load_embedder`)
as LangChain embeddings (types only; offline). Exported by :mod:`..langchain` as
``local_embeddings``; here, beside the embedder, so that the Postgres store's LangChain
vector store (``postgres/frameworks.py``) uses it without importing the LangChain adapters."""

from __future__ import annotations

from langchain_core.embeddings import Embeddings

from ..retrieval.embedder import Embedder, load_embedder


class LocalEmbeddings(Embeddings):
    """A loaded sentence-transformers model as LangChain embeddings."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.encode(list(texts)).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text)


def local_embeddings(device: str = "cpu") -> LocalEmbeddings:
    """LangChain embeddings over the packaged all-MiniLM-L6-v2 (384 dimensions, vectors
    L2-normalised, so cosine and dot-product rankings agree); nothing is downloaded.

    Args:
        device: torch device for the sentence-transformer (``"cpu"``, ``"cuda"``...).
    """
    return LocalEmbeddings(load_embedder(device=device))
