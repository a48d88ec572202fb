"""The one loaded MiniLM embedder (:func:`~tokrag_integrations.retrieval.embedder.load_embedder`)
as a LlamaIndex embedding model (types only; offline)."""

from __future__ import annotations

from functools import cache
from typing import Any

from ..retrieval.embedder import Embedder, load_embedder

#: How to install what this subpackage needs (in its import errors).
INSTALL_HINT = "pip install 'tokrag-integrations[llamaindex]'"


def local_embedding(device: str = "cpu", **kwargs: Any) -> Any:
    """A LlamaIndex ``BaseEmbedding`` over the packaged all-MiniLM-L6-v2 (dim 384, vectors
    L2-normalised); nothing is downloaded.

    Args:
        device: torch device for the encoder.
        **kwargs: ``BaseEmbedding`` fields (e.g. ``embed_batch_size``).
    """
    return embedding_class()(load_embedder(device=device), **kwargs)


@cache
def embedding_class() -> type:
    """The ``BaseEmbedding`` subclass over an :class:`Embedder` (built on first use, so
    importing this module imports no LlamaIndex)."""
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.bridge.pydantic import PrivateAttr

    class LocalEmbedding(BaseEmbedding):
        """A loaded sentence-transformers model as a LlamaIndex embedding."""

        _embedder: Any = PrivateAttr()

        def __init__(self, embedder: Embedder, **kwargs: Any) -> None:
            super().__init__(model_name=embedder.name, **kwargs)
            self._embedder = embedder

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embedder.embed_query(query)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embedder.embed_query(text)

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.encode(list(texts)).tolist()

    return LocalEmbedding
