"""Citations on the packaged model (issue 46's acceptance): the answer's fact is cited to the
one passage that holds it, whichever place it has in the prompt; citations off records none."""

from __future__ import annotations

import pytest

from tokrag_integrations import Passage, generate

QUESTION = "Who founded Quillfeather Aerospace?"
ON_TOPIC = Passage(
    "Quillfeather Aerospace builds small satellites in a factory near the coast of Norway. "
    "It employs 300 people.",
    metadata={"source": "factory.md"},
)
WITH_FACT = Passage(
    "Quillfeather Aerospace was founded in 1994 by Ottoline Varga, a physicist.",
    metadata={"source": "history.md"},
)
FACT = "Ottoline Varga"


def _fact_steps(trace) -> tuple[int, int]:
    """The steps whose tokens overlap the fact in the generated text."""
    texts = [s.text for s in trace.steps]
    full = "".join(texts)
    at = full.find(FACT)
    assert at >= 0, f"the answer lacks the fact: {full!r}"
    pos, hit = 0, []
    for i, t in enumerate(texts):
        if pos < at + len(FACT) and pos + len(t) > at:
            hit.append(i)
        pos += len(t)
    return hit[0], hit[-1] + 1


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_the_fact_is_cited_to_the_passage_holding_it_in_either_order(lm, policy):
    for passages, holder in (([ON_TOPIC, WITH_FACT], 1), ([WITH_FACT, ON_TOPIC], 0)):
        r = generate(lm, QUESTION, passages, policy=policy, max_new_tokens=22, citations=True)
        start, end = _fact_steps(r.trace)
        passage, share = r.trace.cite(start, end)
        assert passage == holder, r.trace.citations()
        assert share > 0.5
        spans = [c for c in r.trace.citations() if c.start < end and c.end > start]
        assert any(c.passage == holder and c.source == "history.md" for c in spans)
        assert all(len(s.citation) == 2 for s in r.trace.steps)


def test_citations_by_default_off_and_without_a_rag_context(lm):
    """By default only the policies that probe the RAG context anyway cite; True adds the
    probe (the same tokens), False records nothing, a policy without a RAG context none."""
    passages = [ON_TOPIC, WITH_FACT]
    default = generate(lm, QUESTION, passages, max_new_tokens=4)  # tokrag
    assert all(len(s.citation) == 2 for s in default.trace.steps)
    rag = generate(lm, QUESTION, passages, policy="rag", max_new_tokens=6)
    forced = generate(lm, QUESTION, passages, policy="rag", max_new_tokens=6, citations=True)
    assert forced.token_ids == rag.token_ids  # reading the attention changes no token
    assert all(len(s.citation) == 2 for s in forced.trace.steps)
    off = generate(lm, QUESTION, passages, max_new_tokens=4, citations=False)
    llm = generate(lm, QUESTION, passages, policy="no_rag", max_new_tokens=4, citations=True)
    for r in (rag, off, llm):
        assert all(not s.citation for s in r.trace.steps)
        assert all(c.passage is None for c in r.trace.citations())
    with pytest.raises(TypeError, match="citations"):
        generate(lm, QUESTION, [WITH_FACT], citations="yes")


@pytest.mark.parametrize("policy", ["rag_token", "rag_sequence"])
def test_one_context_per_passage_cites_by_the_posterior(lm, policy):
    """RAG-Token and RAG-Sequence cite each token to p(z|x, y_i) ∝ p(z|x)·p(y_i|x, z, y<i)
    (on by default: it costs nothing); ``citations=False`` records none."""
    for passages, holder in (([ON_TOPIC, WITH_FACT], 1), ([WITH_FACT, ON_TOPIC], 0)):
        r = generate(lm, QUESTION, passages, policy=policy, max_new_tokens=22)
        start, end = _fact_steps(r.trace)
        assert r.trace.cite(start, end)[0] == holder, r.trace.citations()
        assert all(abs(sum(s.citation) - 1) < 1e-6 for s in r.trace.steps[start:end])
    off = generate(lm, QUESTION, passages, policy=policy, max_new_tokens=4, citations=False)
    assert all(not s.citation for s in off.trace.steps)
