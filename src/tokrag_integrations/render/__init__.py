"""Renderers for :class:`~tokrag_integrations.trace.Trace`: a standalone HTML page and a
terminal view (rich).

Both colour every generated token by its source: ``agree`` (both contexts chose it) is
neutral grey, ``rag`` (taken from the retrieval-augmented context) green, ``llm`` (taken from
the model's own, passage-free context) blue; any other label a policy uses (``mix``,
``passage:0``...) is amber. Hovering a token in the HTML page shows each context's top-1
candidate with its probability and the signals behind the decision (Tok-RAG paper, Fig. 5).

The page is built in :mod:`._html` (its stylesheet and script in :mod:`._assets`), the
terminal view in :mod:`._terminal`; both read a trace through the protocols of
:mod:`._view`, never importing :mod:`tokrag_integrations.trace`.
"""

from __future__ import annotations

from ._common import format_timing, format_value, source_label
from ._html import trace_to_html
from ._terminal import render_trace

__all__ = ["trace_to_html", "render_trace", "source_label", "format_value", "format_timing"]
