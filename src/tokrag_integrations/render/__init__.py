"""Renderers for :class:`~tokrag_integrations.trace.Trace`: a standalone HTML page
(:mod:`._html`, styles in :mod:`._assets`) and a terminal view (:mod:`._terminal`, rich).

Both colour every generated token by its source: ``agree`` grey, ``rag`` (from the retrieval
context) green, ``pure`` (from the passage-free context) blue, any other label amber. Hovering
a token in the page shows each context's top-1 candidate and the signals behind the decision
(Tok-RAG paper, Fig. 5). They read a trace through the protocols of :mod:`._view`.
"""

from __future__ import annotations

from ._common import format_value
from ._html import trace_to_html
from ._terminal import render_trace

__all__ = ["trace_to_html", "render_trace", "format_value"]
