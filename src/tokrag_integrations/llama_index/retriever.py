"""``tokrag ask --docs``'s retrieval as a LlamaIndex retriever (the same passages as the
command line)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from ..defaults import CHUNK_CHARS, CHUNK_OVERLAP, RETRIEVER, TOP_K
from ..retrieval import ScoredChunk, build_retriever


def _node(hit: ScoredChunk) -> NodeWithScore:
    """A retrieved chunk as a node whose LLM and embedding text is the chunk's text alone."""
    metadata = {"source": hit.source, "chunk": hit.chunk.index, **hit.chunk.metadata}
    node = TextNode(
        id_=f"{hit.source}#{hit.chunk.index}",
        text=hit.text,
        metadata=metadata,
        excluded_llm_metadata_keys=list(metadata),
        excluded_embed_metadata_keys=list(metadata),
    )
    return NodeWithScore(node=node, score=hit.score)


class FolderRetriever(BaseRetriever):
    """Files and folders chunked, embedded and searched exactly as ``tokrag ask --docs`` (its
    loader, chunking, top-k and cached MiniLM embeddings).

        >>> from llama_index.core.query_engine import RetrieverQueryEngine
        >>> from tokrag_integrations.llama_index import TokRAGSynthesizer
        >>> retriever = FolderRetriever("my_docs/")
        >>> engine = RetrieverQueryEngine(retriever, response_synthesizer=TokRAGSynthesizer())
        >>> response = engine.query("Who founded Quillfeather Aerospace?")
        >>> response.metadata["policy"], len(response.source_nodes) > 0
        ('tokrag', True)

    Args:
        paths: a file or folder, or several.
        top_k: chunks returned per query.
        retriever: ``"dense"`` (MiniLM cosine), ``"bm25"`` or ``"hybrid"`` (both, fused by
            reciprocal rank fusion), as ``--retriever``; default
            :data:`~tokrag_integrations.defaults.RETRIEVER`.
        max_chars / overlap: chunking, see :func:`tokrag_integrations.retrieval.chunk_text`.
        cache: keep the chunk embeddings on disk (dense and hybrid).
        follow_links: read files through symbolic links that leave the folders.
        max_file_mb: the largest file read, in MB (bigger ones are skipped with a warning;
            default 100).
        progress: say on stderr what is being indexed (plain lines when not a terminal).

    Raises:
        FileNotFoundError: a path does not exist. ValueError: nothing to index, a bad
        ``top_k``, ``retriever`` or chunking.
    """

    def __init__(
        self,
        paths: str | Path | Iterable[str | Path],
        *,
        top_k: int = TOP_K,
        retriever: Literal["dense", "bm25", "hybrid"] = RETRIEVER,
        max_chars: int = CHUNK_CHARS,
        overlap: int = CHUNK_OVERLAP,
        cache: bool = True,
        follow_links: bool = False,
        max_file_mb: float | None = None,
        progress: bool = False,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a whole number >= 1, got {top_k!r}")
        self._top_k = top_k
        self._retriever: Any = build_retriever(
            paths,
            kind=retriever,
            max_chars=max_chars,
            overlap=overlap,
            cache=cache,
            follow_links=follow_links,
            max_file_mb=max_file_mb,
            progress=progress,
        )
        super().__init__(callback_manager=callback_manager)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self._retriever.retrieve(query_bundle.query_str, top_k=self._top_k)
        return [_node(h) for h in hits]
