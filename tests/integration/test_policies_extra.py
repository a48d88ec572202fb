"""Extra decoding policies (spec §5): selection baselines, CAD / AdaCAD, RAG-Token, RAG-Sequence.

This file holds the cases that need the real model, a database, a server or a subprocess; the others are in
``tests/unit/test_policies_extra.py``."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.prompts import Passage

# ------------------------------------------------------------------------- real model
Q = "Who founded Quillfeather Aerospace?"
P1 = "Quillfeather Aerospace was founded in 2009 by Mara Ellison in Tromsø."
P2 = "Quillfeather makes small satellite launchers and employs 300 people."


def test_rag_token_single_passage_equals_rag(lm):
    from tokrag_integrations import generate

    rag = generate(lm, Q, [P1], policy="rag", max_new_tokens=10)
    tok = generate(lm, Q, [Passage(P1, score=0.3)], policy="rag_token", max_new_tokens=10)
    assert tok.token_ids == rag.token_ids and tok.text == rag.text
    assert {s.source for s in tok.trace.steps} == {"passage:0"}
    cad0 = generate(lm, Q, [P1], policy="cad", max_new_tokens=10, policy_options={"alpha": 0.0})
    assert cad0.token_ids == rag.token_ids
    # Shared prefill (evaluation harness, decoding in its own thread): a copied KV cache
    # decodes exactly like a fresh one.
    from tokrag_integrations.contexts.prefill import shared_prefill

    with shared_prefill() as store:
        first = generate(lm, Q, [P1], policy="cad", max_new_tokens=10, policy_options={"alpha": 0.0}, batching=False)
        second = generate(lm, Q, [P1], policy="rag", max_new_tokens=10, batching=False)
        assert len(store) == 2  # pure and rag contexts, prefilled once
    assert first.token_ids == second.token_ids == rag.token_ids


def test_rag_sequence_picks_the_best_scored_candidate(lm):
    from tokrag_integrations import generate

    r = generate(lm, Q, [P1, P2], policy="rag_sequence", max_new_tokens=8)
    cands = r.trace.steps[0].signals["rag_sequence"]
    assert 1 <= len(cands) <= 2
    best = max(cands, key=lambda c: c["log_p"])
    assert best["chosen"] and r.text == best["text"]
    for c in cands:  # p(y|x) = Σ_z ½ p(y|x,z)
        lp = torch.logsumexp(torch.tensor(c["log_p_passages"]) + math.log(0.5), 0).item()
        assert c["log_p"] == pytest.approx(lp, abs=1e-3)
    assert r.trace.steps[0].source.startswith("passage:")

