"""tokrag-integrations: token-level benefit/detriment harmonisation for RAG (Tok-RAG).

Importing the package is cheap; torch and transformers load on first use.

    >>> from tokrag_integrations import load_model, generate
    >>> lm = load_model()                     # SmolLM2-135M-Instruct, packaged
    >>> r = generate(lm, "Who founded Quillfeather?", ["Quillfeather was founded by ..."])
    >>> r.text, r.trace.counts()
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "models",
    "LoadedModel": "models",
    "generate": "api",
    "stream": "api",
    "generate_batch": "api",
    "agenerate": "api",
    "astream": "api",
    "astream_with_result": "api",
    "GenerationResult": "api",
    "TokenEvent": "api",
    "Passage": "prompts",
    "PromptBuilder": "prompts",
    "RenderedPrompt": "prompts",
    "Trace": "trace",
    "TraceStep": "trace",
    "get_policy": "policies",
    "available_policies": "policies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        mod = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(mod, name)
    raise AttributeError(f"module 'tokrag_integrations' has no attribute {name!r}")
