"""The arms of ``tokrag bench``: which policy and options each one decodes with."""

from __future__ import annotations

from typing import Any

__all__ = [
    "ARMS", "DEFAULT_POLICIES", "EXACT_ARMS", "STOCK_ARMS", "THROUGHPUT_ARMS", "arm"]

#: Benchmark arms: name -> (policy, options). ``tokrag`` is the default decoder (the pure and
#: RAG contexts decoded together, step by step: packed into one sequence for one query); ``tokrag-step`` the step-by-step loop as
#: written (one forward pass per context), which every fast path must equal. ``rag-stock`` is ``rag`` on
#: the same model with transformers' stock CPU kernels (``TOKRAG_CPU_KERNELS=off``).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "rag": ("rag", {}),
    "rag-stock": ("rag", {}),
    "floor": ("floor", {}),
    "tokrag-step": ("tokrag", {"speed": "reference"}),
    "tokrag": ("tokrag", {}),
    "llm": ("llm", {}),
}
#: Arms that run on a second copy of the model loaded with the stock kernels.
STOCK_ARMS = frozenset({"rag-stock"})
DEFAULT_POLICIES = ("rag", "floor", "tokrag-step", "tokrag", "rag-stock")
#: Fast arms whose tokens and decisions must equal ``tokrag-step``'s.
EXACT_ARMS = ("tokrag",)
#: Arms timed by ``--throughput`` (those of the run's ``--policies`` that are in it, in this
#: order): one context, both contexts without signals, the default decoder.
THROUGHPUT_ARMS = ("rag", "floor", "tokrag")


def arm(name: str) -> tuple[str, dict[str, Any]]:
    """``(policy, options)`` of a benchmark arm; any policy name is its own arm."""
    return ARMS.get(name, (name, {}))
