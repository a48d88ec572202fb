"""The one set of retrieval and generation defaults.

``tokrag ask``, the examples and the framework adapters all read these, so a question asked
through the CLI, a LlamaIndex query engine built like ``examples/llamaindex_quickstart.py``
or a LangChain chain built like ``examples/langchain_quickstart.py`` sees the same chunks,
the same number of passages and the same answer budget, and stops at the same place.
Changing a value here changes every entry point at once; each entry point still takes its
own argument to override it.
"""

from __future__ import annotations

__all__ = ["CHUNK_CHARS", "CHUNK_OVERLAP", "TOP_K", "MAX_NEW_TOKENS", "ANSWER_STOP"]

#: Characters per chunk (:func:`~tokrag_integrations.retrieval.chunk_text`).
CHUNK_CHARS = 800

#: Characters a chunk may repeat from the end of the previous one.
CHUNK_OVERLAP = 100

#: Chunks retrieved per question and given to the model as passages.
TOP_K = 5

#: New tokens per answer; an answer that reaches it is cut (``stop_reason == "length"``).
MAX_NEW_TOKENS = 64

#: Stop strings of every question-answering entry point, besides the model's end of turn
#: (EOS always stops). A small model given document chunks often ends its answer with a
#: blank line and then goes on copying the document: the next paragraph, or a Markdown
#: heading (``### 4 ...``). The answer therefore ends at its first blank line or at a line
#: that starts a heading; the stop string itself is not part of the answer. Pass ``stop=[]``
#: (``--no-stop`` on the command line) to decode up to the token budget.
ANSWER_STOP: tuple[str, ...] = ("\n\n", "\n#")
