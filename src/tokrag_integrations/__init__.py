"""tokrag-integrations: token-level benefit/detriment harmonisation for RAG (Tok-RAG).

Importing the package is cheap; torch and transformers load on first use.

    >>> from tokrag_integrations import load_model, generate
    >>> lm = load_model()                     # SmolLM2-135M-Instruct, packaged
    >>> r = generate(lm, "Who founded Quillfeather?", ["Quillfeather was founded by Ottoline Varga."],
    ...              max_new_tokens=16)
    >>> r.text
    '...Ottoline Varga...'
    >>> r.trace.counts()                      # how many tokens each source gave: agree / rag / pure
    {...}
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "GenerationResult",
    "LoadedModel",
    "Passage",
    "PromptBuilder",
    "RenderedPrompt",
    "TokenEvent",
    "Trace",
    "TraceStep",
    "agenerate",
    "astream",
    "astream_with_result",
    "available_policies",
    "generate",
    "generate_batch",
    "get_policy",
    "load_model",
    "stream",
]


def __getattr__(name: str) -> Any:
    """The exports, imported on first use (importing the package loads no torch)."""
    if name in ("load_model", "LoadedModel"):
        from . import models as module
    elif name in ("generate", "stream", "generate_batch", "agenerate", "astream", "astream_with_result"):
        from .engine import scheduler as module
    elif name in ("GenerationResult", "TokenEvent"):
        from . import results as module
    elif name in ("Passage", "PromptBuilder", "RenderedPrompt"):
        from . import prompts as module
    elif name in ("Trace", "TraceStep"):
        from . import trace as module
    elif name in ("get_policy", "available_policies"):
        from . import policies as module
    else:
        raise AttributeError(f"module 'tokrag_integrations' has no attribute {name!r}")
    return getattr(module, name)
