"""LlamaIndex routers driven by a gate (the framework is imported lazily).

* :func:`gate_selector` - a ``BaseSelector`` for ``RouterQueryEngine``: choice 0 = the
  direct-LLM engine, choice 1 = the RAG engine (configurable); the gate's decision and score
  are in the selection's ``reason`` (JSON) and so in ``response.metadata["selector_result"]``.
* :func:`gated_query_engine` - a query engine that calls its retriever only when the gate
  says so; ``response.metadata["gate"]`` holds the decision.

No algorithm lives here: the gate decides, these classes translate types.
"""

from __future__ import annotations

import json
from typing import Any


def _require() -> None:
    try:
        import llama_index.core  # noqa: F401
    except ImportError as e:  # pragma: no cover - optional extra
        raise ImportError(
            "the LlamaIndex router needs llama-index-core: pip install 'tokrag-integrations[llamaindex]'"
        ) from e


def gate_selector(gate: Any, *, direct_index: int = 0, rag_index: int = 1) -> Any:
    """A ``BaseSelector`` that picks ``rag_index`` when ``gate.decide(query).retrieve``."""
    _require()
    from llama_index.core.base.base_selector import BaseSelector, SelectorResult, SingleSelection

    class GateSelector(BaseSelector):
        """Route by a retrieval gate (decision and score in the selection's reason)."""

        def __init__(self) -> None:
            self.gate = gate
            self.last_decision: Any = None

        def _get_prompts(self) -> dict[str, Any]:
            return {}

        def _update_prompts(self, prompts: dict[str, Any]) -> None:
            pass

        def _select(self, choices: Any, query: Any) -> SelectorResult:
            n = len(choices)
            if max(direct_index, rag_index) >= n:
                raise ValueError(
                    f"the gate selector needs choices {direct_index} (direct) and {rag_index} (RAG); got {n}"
                )
            decision = self.gate.decide(query.query_str)
            self.last_decision = decision
            idx = rag_index if decision.retrieve else direct_index
            reason = json.dumps(
                {"route": "rag" if decision.retrieve else "direct", **_brief(decision)}
            )
            return SelectorResult(selections=[SingleSelection(index=idx, reason=reason)])

        async def _aselect(self, choices: Any, query: Any) -> SelectorResult:
            import asyncio

            return await asyncio.to_thread(self._select, choices, query)

    return GateSelector()


def _brief(decision: Any) -> dict[str, Any]:
    d = decision.to_dict()
    return {k: d[k] for k in ("gate", "retrieve", "score", "threshold", "retrieve_when") if k in d}


def gated_query_engine(
    gate: Any, retriever: Any, synthesizer: Any, *, callback_manager: Any = None
) -> Any:
    """A query engine that retrieves only when ``gate`` says so.

    Args:
        gate: a :class:`..base.Gate`.
        retriever: a LlamaIndex retriever (``retrieve(QueryBundle)``).
        synthesizer: e.g. ``TokRAGSynthesizer(lm, policy="rag")``; with no nodes it answers
            from the pure context.
        callback_manager: the caller's; by default the synthesizer's, else
            ``Settings.callback_manager`` (handlers such as ``TokenCountingHandler`` keep
            seeing the engine's events).
    """
    _require()
    from llama_index.core import Settings
    from llama_index.core.base.base_query_engine import BaseQueryEngine

    class GatedQueryEngine(BaseQueryEngine):
        """Skip retrieval when the gate says the model knows; decision in the metadata."""

        def __init__(self) -> None:
            super().__init__(
                callback_manager=callback_manager
                or getattr(synthesizer, "callback_manager", None)
                or Settings.callback_manager
            )
            self.gate, self.retriever, self.synthesizer = gate, retriever, synthesizer

        def _get_prompt_modules(self) -> dict[str, Any]:
            return {}

        def _query(self, query_bundle: Any) -> Any:
            decision = self.gate.decide(query_bundle.query_str)
            nodes = self.retriever.retrieve(query_bundle) if decision.retrieve else []
            response = self.synthesizer.synthesize(query_bundle, nodes)
            meta = dict(response.metadata or {})
            meta["gate"] = decision.to_dict()
            meta["gate"].pop("details", None)
            meta["gate_details"] = {
                k: v
                for k, v in decision.to_dict().get("details", {}).items()
                if k not in ("result", "tokens")
            }
            meta["route"] = "rag" if decision.retrieve else "direct"
            response.metadata = meta
            return response

        async def _aquery(self, query_bundle: Any) -> Any:
            import asyncio

            return await asyncio.to_thread(self._query, query_bundle)

    return GatedQueryEngine()
