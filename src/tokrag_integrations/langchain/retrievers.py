"""``tokrag ask --docs``'s retrieval as a LangChain retriever (the same passages as the
command line)."""

from __future__ import annotations

from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, PrivateAttr, StrictBool

from ..defaults import CHUNK_CHARS, CHUNK_OVERLAP, RETRIEVER, TOP_K
from ..retrieval import build_retriever


class FolderRetriever(BaseRetriever):
    """Files and folders chunked, embedded and searched exactly as ``tokrag ask --docs`` (its
    loader, chunking, top-k and cached MiniLM embeddings). Each Document's ``page_content``
    is the chunk; its metadata holds ``source``, ``chunk``, ``score``, ``title``, ``format``.

        >>> retriever = FolderRetriever(paths=["my_docs/"])
        >>> retriever.invoke("Who founded Quillfeather Aerospace?")[0].metadata["score"]
        0...

    Raises (at construction): ``FileNotFoundError`` for a path that does not exist,
    ``ValueError`` when there is nothing to index or a setting is out of range.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt setting is an error, not ignored

    paths: list[str]
    """Files and/or folders to index."""
    top_k: int = Field(default=TOP_K, ge=1)
    """Chunks returned per query."""
    retriever: Literal["dense", "bm25", "hybrid"] = RETRIEVER
    """``"dense"`` (MiniLM cosine), ``"bm25"`` or ``"hybrid"`` (both, fused by reciprocal rank
    fusion), as ``--retriever``."""
    max_chars: int = Field(default=CHUNK_CHARS, ge=1)
    """Characters per chunk (see :func:`tokrag_integrations.retrieval.chunk_text`)."""
    overlap: int = Field(default=CHUNK_OVERLAP, ge=0)
    """Characters a chunk may repeat from the previous one."""
    cache: StrictBool = True
    """Keep the chunk embeddings on disk (dense and hybrid)."""
    follow_links: StrictBool = False
    """Read files through symbolic links that leave the folders."""
    max_file_mb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """The largest file read, in MB (bigger ones are skipped with a warning); ``None``:
    100 MB."""
    progress: StrictBool = False
    """Say on stderr what is being indexed (plain lines when not a terminal)."""

    _retriever: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        self._retriever = build_retriever(
            self.paths,
            kind=self.retriever,
            max_chars=self.max_chars,
            overlap=self.overlap,
            cache=self.cache,
            follow_links=self.follow_links,
            max_file_mb=self.max_file_mb,
            progress=self.progress,
        )

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return [
            Document(
                page_content=h.text,
                metadata={
                    **h.chunk.metadata,
                    "source": h.source,
                    "chunk": h.chunk.index,
                    "score": h.score,
                },
            )
            for h in self._retriever.retrieve(query, top_k=self.top_k)
        ]
