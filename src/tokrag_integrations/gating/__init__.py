"""Retrieval gating: decide per query whether to retrieve, with the score behind the decision.

Gates (all framework-free; the routers are in the framework packages:
:mod:`~tokrag_integrations.llama_index.gated_engine`,
:mod:`~tokrag_integrations.langchain.gated_router`):

* :class:`ConfidenceGate` - the five Confident-RAG metrics of a pure draft (seed 003);
* :class:`GECEGate` - long-tail detection, Eq. 2 of seed 004 (``gold`` / ``self``);
* :class:`CtrlAGate` - representation-based confidence monitoring (seed 002);
* :func:`confident_rag` - several retrievers, one answer each, keep the most confident.
"""

from __future__ import annotations

from .confidence import (
    METRICS,
    ConfidenceGate,
    ConfidenceScores,
    metrics_from_probs,
    metrics_from_stats,
)
from .confident_rag import ConfidentRAGResult, confident_rag
from .ctrla import CtrlAGate
from .gate_base import Gate, GateDecision
from .gece import GECEGate

GATES = {"confidence": ConfidenceGate, "gece": GECEGate, "ctrla": CtrlAGate}

__all__ = [
    "GATES",
    "METRICS",
    "ConfidenceGate",
    "ConfidenceScores",
    "ConfidentRAGResult",
    "CtrlAGate",
    "GECEGate",
    "Gate",
    "GateDecision",
    "confident_rag",
    "metrics_from_probs",
    "metrics_from_stats",
]
