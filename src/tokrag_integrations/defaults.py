"""The one set of retrieval and generation defaults.

``tokrag ask``, the examples and the framework adapters all read these, so every entry point
sees the same chunks, the same number of passages and the same answer budget, and stops at
the same place; each entry point still takes its own argument to override them.
"""

from __future__ import annotations

__all__ = [
    "ANSWER_STOP", "CHUNK_CHARS", "CHUNK_OVERLAP", "CITATIONS", "MAX_NEW_TOKENS", "RETRIEVER", "TOP_K",
]  # fmt: skip

#: Characters per chunk (:func:`~tokrag_integrations.retrieval.chunk_text`).
CHUNK_CHARS = 800

#: Characters a chunk may repeat from the end of the previous one.
CHUNK_OVERLAP = 100

#: How ``--docs`` and ``FolderRetriever`` rank chunks: ``"dense"`` (MiniLM cosine),
#: ``"bm25"`` or ``"hybrid"`` (the two fused by reciprocal rank fusion). Hybrid has the better
#: recall, but the packaged model answers fewer sample questions with it (docs/results.md).
RETRIEVER = "dense"

#: Chunks retrieved per question and given to the model as passages.
TOP_K = 5

#: New tokens per answer; an answer that reaches it is cut (``stop_reason == "length"``).
MAX_NEW_TOKENS = 64

#: Stop strings of every question-answering entry point besides EOS (not part of the answer):
#: a blank line, or a line starting a Markdown heading, where a small model given document
#: chunks goes on copying the document. ``stop=[]`` (``--no-stop``) decodes to the budget.
ANSWER_STOP: tuple[str, ...] = ("\n\n", "\n#")

#: Whether a decode records citations (each passage's share of the RAG context's attention at
#: every generated step): None = where the policy already probes the RAG context (``tokrag``,
#: ``tokrag_authors``: +4 % per token), True = for every policy with a RAG context (others
#: then probe it: +9 % per token for ``rag``), False = never (docs/results.md, "Citations").
CITATIONS: bool | None = None

#: The largest answer a remote client (``base_url=``) reads from a server, in MB of 2**20
#: bytes (``max_response_mb=``); a traced answer of 512 tokens over 20 passages is under 2 MB.
REMOTE_MAX_RESPONSE_MB = 32.0
