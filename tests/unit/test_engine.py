"""The decoding engine on the real default model (SmolLM2-135M-Instruct).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_engine.py``."""

from __future__ import annotations

import pytest


def test_pr_skip_is_checked():
    from tokrag_integrations.policies.tokrag import TokRAG

    with pytest.raises(ValueError, match="pr_skip"):
        TokRAG(pr_skip="commas")


def test_verdict_gate_is_checked():
    from tokrag_integrations.policies.tokrag import TokRAG

    for bad in ("pure", True, "RAG"):
        with pytest.raises(ValueError, match="verdict_gate"):
            TokRAG(verdict_gate=bad)


def test_rising_gate_is_checked():
    from tokrag_integrations.policies.tokrag import TokRAG

    with pytest.raises(ValueError, match="rising_gate"):
        TokRAG(rising_gate="yes")
    assert TokRAG().options()["rising_gate"] is True and TokRAG(rising_gate=False).options()["rising_gate"] is False


def test_punctuation_gate_is_checked():
    from tokrag_integrations.policies.tokrag import TokRAG

    with pytest.raises(ValueError, match="punctuation_gate"):
        TokRAG(punctuation_gate="yes")
    assert TokRAG().options()["punctuation_gate"] is True and TokRAG(punctuation_gate=False).options()["punctuation_gate"] is False
