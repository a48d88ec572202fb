"""LlamaIndex routing by a retrieval gate: a selector for ``RouterQueryEngine`` and a query
engine that retrieves only when the gate says so."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from llama_index.core import Settings
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.base_selector import BaseSelector, SelectorResult, SingleSelection

from ..adapters.translate import gate_summary

_BRIEF = ("gate", "retrieve", "score", "threshold", "retrieve_when")


class GateSelector(BaseSelector):
    """Route by a retrieval gate (decision and score in the selection's reason)."""

    def __init__(self, gate: Any, direct_index: int = 0, rag_index: int = 1) -> None:
        self.gate, self.direct_index, self.rag_index = gate, direct_index, rag_index
        self.last_decision: Any = None

    def _get_prompts(self) -> dict[str, Any]:
        return {}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        pass

    def _select(self, choices: Any, query: Any) -> SelectorResult:
        if max(self.direct_index, self.rag_index) >= len(choices):
            raise ValueError(
                f"the gate selector needs choices {self.direct_index} (direct) and "
                f"{self.rag_index} (RAG); got {len(choices)}"
            )
        decision = self.last_decision = self.gate.decide(query.query_str)
        d = decision.to_dict()
        reason = json.dumps(
            {
                "route": "rag" if decision.retrieve else "direct",
                **{k: d[k] for k in _BRIEF if k in d},
            }
        )
        idx = self.rag_index if decision.retrieve else self.direct_index
        return SelectorResult(selections=[SingleSelection(index=idx, reason=reason)])

    async def _aselect(self, choices: Any, query: Any) -> SelectorResult:
        return await asyncio.to_thread(self._select, choices, query)


def gate_selector(gate: Any, *, direct_index: int = 0, rag_index: int = 1) -> GateSelector:
    """A ``BaseSelector`` that picks ``rag_index`` when ``gate.decide(query).retrieve``, else
    ``direct_index``; the decision is in the selection's ``reason`` (JSON), so in
    ``response.metadata["selector_result"]``."""
    return GateSelector(gate, direct_index, rag_index)


class GatedQueryEngine(BaseQueryEngine):
    """Skip retrieval when the gate says the model knows; decision in the metadata."""

    def __init__(self, gate: Any, retriever: Any, synthesizer: Any, callback_manager: Any = None):
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
        gate, details = gate_summary(decision)
        response.metadata = {
            **(response.metadata or {}),
            "gate": gate,
            "gate_details": details,
            "route": "rag" if decision.retrieve else "direct",
        }
        return response

    async def _aquery(self, query_bundle: Any) -> Any:
        return await asyncio.to_thread(self._query, query_bundle)


def gated_query_engine(
    gate: Any, retriever: Any, synthesizer: Any, *, callback_manager: Any = None
) -> GatedQueryEngine:
    """A query engine that retrieves only when ``gate`` says so (the decision in
    ``response.metadata["gate"]``).

    Args:
        gate: a :class:`~tokrag_integrations.gating.Gate`.
        retriever: a LlamaIndex retriever (``retrieve(QueryBundle)``).
        synthesizer: e.g. ``TokRAGSynthesizer(lm, policy="rag")``; with no nodes it answers
            from the pure context.
        callback_manager: the caller's; by default the synthesizer's, else
            ``Settings.callback_manager``.
    """
    return GatedQueryEngine(gate, retriever, synthesizer, callback_manager)
