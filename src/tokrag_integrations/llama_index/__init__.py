"""LlamaIndex adapters for Tok-RAG: a response synthesizer, an LLM and a local embedding.

The adapters translate types only (nodes -> :class:`~tokrag_integrations.Passage`, core
results -> LlamaIndex responses); every decoding decision lives in the core.

    >>> from tokrag_integrations.llama_index import TokRAGSynthesizer, local_embedding
    >>> index = VectorStoreIndex.from_documents(docs, embed_model=local_embedding())
    >>> synth = TokRAGSynthesizer(policy="tokrag")
    >>> engine = RetrieverQueryEngine(index.as_retriever(), response_synthesizer=synth)
    >>> response = engine.query("Who founded Quillfeather?")
    >>> response.metadata["counts"], response.metadata["trace"]

Importing this subpackage needs ``llama-index-core``; importing :mod:`tokrag_integrations`
itself never imports LlamaIndex.
"""

from __future__ import annotations

# embeddings.py imports nothing from LlamaIndex at module level: safe before the check below.
from .embeddings import INSTALL_HINT

try:
    import llama_index.core  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tokrag_integrations.llama_index needs LlamaIndex (llama-index-core 0.14), which is not "
        f"installed. Install the extra: {INSTALL_HINT}"
    ) from e

from .embeddings import local_embedding  # noqa: E402
from .llm import TokRAGLLM  # noqa: E402
from .retriever import FolderRetriever  # noqa: E402
from .synthesizer import RESPONSE_MODES, TokRAGSynthesizer  # noqa: E402

__all__ = [
    "INSTALL_HINT",
    "RESPONSE_MODES",
    "FolderRetriever",
    "TokRAGLLM",
    "TokRAGSynthesizer",
    "local_embedding",
]
