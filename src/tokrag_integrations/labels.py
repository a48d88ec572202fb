"""Where a generated token came from: the source labels of :class:`.trace.TraceStep`.

A leaf module (no imports), so that the policies, :mod:`.trace` and :mod:`.render` share the
labels without importing each other; :mod:`.trace` re-exports them.
"""

#: Source labels used by the two-context policies (docs/algorithm.md, "The loop"). Other policies add their own
#: labels (``mix`` for logit blends such as CAD, ``passage:<j>`` for single-passage picks).
AGREE, FROM_RAG, FROM_PURE = "agree", "rag", "pure"
