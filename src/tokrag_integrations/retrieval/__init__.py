"""Framework-free local retrieval for ``tokrag ask --docs`` (neither LlamaIndex nor LangChain
needed): load files (:func:`load_documents`, through :func:`read_document`, the one loader
``tokrag ingest`` shares), cut them (:func:`chunk_text`), and rank chunks with
:class:`DenseRetriever` (MiniLM cosine, :mod:`.embedder`), :class:`BM25Retriever` or
:class:`HybridRetriever` (the two fused, :mod:`.fusion`), each
``retrieve(query, top_k=5) -> list[ScoredChunk]``, best first. :func:`build_retriever` does
all three in one call. Nothing is dropped silently: skipped files warn.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from ..config import require_bool
from ..defaults import CHUNK_CHARS, CHUNK_OVERLAP, RETRIEVER
from .chunking import chunk_documents, chunk_text
from .documents import (
    SUPPORTED_SUFFIXES,
    Chunk,
    Document,
    DocumentError,
    ScoredChunk,
    list_folder,
    printable,
    read_document,
    supported_types,
    walk_paths,
)
from .index import BM25Retriever, DenseRetriever, HybridRetriever, check_retriever
from .opener import DEFAULT_MAX_FILE_MB, max_file_bytes

__all__ = [
    "SUPPORTED_SUFFIXES", "DEFAULT_MAX_FILE_MB", "Document", "Chunk",
    "ScoredChunk", "DenseRetriever", "BM25Retriever", "HybridRetriever", "read_document", "supported_types",
    "load_documents", "list_folder", "printable", "chunk_text", "chunk_documents",
    "build_retriever", "get_sample_docs_path", "get_sample_questions",
]  # fmt: skip

#: Total input size above which :func:`load_documents` warns that in-memory indexing is slow.
LARGE_INPUT_BYTES = 10 * 1024 * 1024


def _warn_if_large(files: Sequence[Path], cap: int) -> None:
    """One warning when the files add up to more than :data:`LARGE_INPUT_BYTES` (files over
    the size cap ``cap`` are not counted: they are skipped with a warning of their own)."""
    sizes = []
    for file in files:
        try:
            size = file.stat().st_size
        except OSError:
            continue
        if size <= cap:
            sizes.append((size, file))
    total = sum(size for size, _ in sizes)
    if not sizes or total <= LARGE_INPUT_BYTES:
        return
    size, biggest = max(sizes, key=lambda item: item[0])
    warnings.warn(
        f"{len(sizes)} document file(s) hold {total / 2**20:.1f} MB (largest: {printable(biggest)}, "
        f"{size / 2**20:.1f} MB); indexing them in memory embeds every chunk on each run and "
        "can take many minutes and gigabytes of memory. For large collections use "
        "`tokrag ingest` once and `tokrag ask --store postgres`.",
        ResourceWarning,
        stacklevel=3,
    )


def load_documents(
    paths: str | Path | Iterable[str | Path],
    *,
    follow_links: bool = False,
    max_file_mb: float | None = None,
) -> list[Document]:
    """Text, Markdown, reStructuredText, HTML and PDF files (folders recursively, in path
    order) through :func:`read_document`, in the order the paths were given.

    Args:
        follow_links: Also read symbolic links whose target is outside the given folders
            (a file named directly counts its own folder as its root), with a warning each.
        max_file_mb: The largest file read, in MB (default 100).

    Raises:
        FileNotFoundError: A path does not exist.
        ValueError: A file named explicitly has an unsupported suffix, no document at all
            was found, or ``max_file_mb`` is not a number above 0.

    Warns:
        UnicodeWarning: A file is not valid UTF-8 (loaded with replacement characters).
        UserWarning: One per file or sub-folder skipped (unreadable, empty, binary, a broken
            PDF, a special file, too big, a link leaving its folder); one per folder for the
            files of other types.
        ResourceWarning: The files add up to more than :data:`LARGE_INPUT_BYTES`.
    """
    path_list = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    cap = max_file_bytes(max_file_mb)  # a bad cap fails before any file is read
    walk = walk_paths(path_list, follow_links=follow_links)
    if walk.unsupported:
        raise ValueError(
            f"Unsupported document type: {walk.unsupported[0]} (supported: {supported_types()})."
        )
    for entry, reason in walk.skipped:
        warnings.warn(f"{printable(entry)}: {printable(reason)}; skipped.", stacklevel=2)
    files = [file for file, _ in walk.files]
    documents: list[Document] = []
    _warn_if_large(files, cap)
    for file in files:
        try:
            documents.append(
                read_document(
                    file, roots=walk.roots, follow_links=follow_links, max_file_mb=max_file_mb
                )
            )
        except DocumentError as exc:
            warnings.warn(f"{printable(file)}: {printable(str(exc))}; skipped.", stacklevel=2)
    if not documents:
        names = ", ".join(str(p) for p in path_list)
        raise ValueError(f"No documents found in {names} (looked for {supported_types()}).")
    return documents


def build_retriever(
    paths_or_chunks: str | Path | Iterable[str | Path] | Sequence[Chunk] | Sequence[Document],
    kind: Literal["dense", "bm25", "hybrid"] = RETRIEVER,
    *,
    max_chars: int = CHUNK_CHARS,
    overlap: int = CHUNK_OVERLAP,
    device: str = "cpu",
    progress: bool = False,
    follow_links: bool = False,
    cache: bool = False,
    max_file_mb: float | None = None,
) -> DenseRetriever | BM25Retriever | HybridRetriever:
    """Load, chunk and index in one call.

    Args:
        paths_or_chunks: Files/folders (see :func:`load_documents`, with ``follow_links`` and
            ``max_file_mb``), or loaded :class:`Document` or :class:`Chunk` objects.
        kind: ``"dense"`` (MiniLM cosine), ``"bm25"`` or ``"hybrid"`` (both, fused by
            reciprocal rank fusion); default :data:`~tokrag_integrations.defaults.RETRIEVER`.
        max_chars / overlap: Chunking, see :func:`chunk_text`.
        device: Torch device for the dense embedder.
        progress: Say on stderr what is being indexed, with a progress bar while embedding.
        cache: Dense and hybrid: keep chunk embeddings on disk and reuse them
            (:class:`.index.EmbeddingCache`), so a folder indexed again embeds only what changed.

    Raises:
        ValueError: Unknown ``kind``, or nothing to index.
        FileNotFoundError: A path does not exist.
    """
    check_retriever(kind)
    require_bool(progress, "progress")
    items: list[Any] = (
        [paths_or_chunks] if isinstance(paths_or_chunks, (str, Path)) else list(paths_or_chunks)
    )
    if items and all(isinstance(i, Chunk) for i in items):
        chunks: list[Chunk] = items
    elif items and all(isinstance(i, Document) for i in items):
        chunks = chunk_documents(items, max_chars=max_chars, overlap=overlap)
    else:
        chunks = chunk_documents(
            load_documents(items, follow_links=follow_links, max_file_mb=max_file_mb),
            max_chars=max_chars,
            overlap=overlap,
        )
    if progress:
        n_docs = len({c.source for c in chunks})
        print(
            f"Indexing {len(chunks)} chunks from {n_docs} document(s) ({kind})…",
            file=sys.stderr,
            flush=True,
        )
    if kind == "bm25":
        return BM25Retriever(chunks)
    dense = DenseRetriever if kind == "dense" else HybridRetriever
    return dense(chunks, device=device, progress=progress, cache=cache)


def get_sample_docs_path() -> Path:
    """Folder of the packaged sample documents (a fictional company's handbook)."""
    return Path(__file__).resolve().parent.parent / "sample_docs"


def get_sample_questions() -> list[dict[str, Any]]:
    """Questions about the sample documents with their expected answers.

    Each item has ``question``, ``answer`` (a short unique string), ``aliases`` (other
    accepted spellings) and ``source`` (the file name that holds the answer).
    """
    path = Path(__file__).resolve().parent.parent / "sample_questions.json"
    return json.loads(path.read_text(encoding="utf-8"))
