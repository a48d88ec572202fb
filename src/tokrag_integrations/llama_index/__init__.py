"""LlamaIndex adapters for Tok-RAG: a response synthesizer, an LLM, a folder retriever, a
local embedding and gate routing (examples: README.md, docs/integrations.md). They translate
types only; decoding lives in the core.

    >>> from llama_index.core import Settings
    >>> from llama_index.core.query_engine import RetrieverQueryEngine
    >>> from tokrag_integrations.llama_index import FolderRetriever, TokRAGLLM, TokRAGSynthesizer
    >>> Settings.llm = TokRAGLLM()            # LlamaIndex's own engines decode with Tok-RAG
    >>> retriever = FolderRetriever("my_docs/")
    >>> engine = RetrieverQueryEngine(retriever, response_synthesizer=TokRAGSynthesizer())
    >>> engine.query("Who founded Quillfeather Aerospace?").metadata["policy"]
    'tokrag'

Importing this subpackage needs ``llama-index-core``; importing :mod:`tokrag_integrations`
itself never imports LlamaIndex.
"""

from __future__ import annotations

from .local_embedding import INSTALL_HINT, local_embedding

try:
    from .gated_engine import gate_selector, gated_query_engine
    from .llm import TokRAGLLM
    from .retriever import FolderRetriever
    from .synthesizer import RESPONSE_MODES, TokRAGSynthesizer
except ModuleNotFoundError as e:  # pragma: no cover - exercised only without the extra
    if not (e.name or "").startswith("llama_index"):
        raise
    raise ImportError(
        "tokrag_integrations.llama_index needs LlamaIndex (llama-index-core 0.14), which is not "
        f"installed. Install the extra: {INSTALL_HINT}"
    ) from e

__all__ = [
    "INSTALL_HINT",
    "RESPONSE_MODES",
    "FolderRetriever",
    "TokRAGLLM",
    "TokRAGSynthesizer",
    "gate_selector",
    "gated_query_engine",
    "local_embedding",
]
