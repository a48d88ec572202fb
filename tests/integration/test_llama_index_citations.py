"""Citations through LlamaIndex on the packaged model (issue 46's acceptance case): of two
nodes, the second holds the answer's fact and the first is on topic without it. The fact's
span is cited to the node holding it in either order, and ``source_nodes`` puts that node
first; through ``TokRAGSynthesizer`` (sync, streaming, async) and through LlamaIndex's own
synthesizers over ``Settings.llm = TokRAGLLM`` (a stock ``as_query_engine()`` included)."""

from __future__ import annotations

import pytest
from _helpers import require

require("llama_index.core", "llama-index-core")

from llama_index.core import Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.response_synthesizers import get_response_synthesizer  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from tokrag_integrations.llama_index import (  # noqa: E402
    TokRAGLLM,
    TokRAGSynthesizer,
    local_embedding,
)

# The core's acceptance case (tests/integration/test_citations.py), as nodes.
QUESTION = "Who founded Quillfeather Aerospace?"
ON_TOPIC = TextNode(
    text="Quillfeather Aerospace builds small satellites in a factory near the coast of Norway. "
    "It employs 300 people.",
    id_="factory",
    metadata={"source": "factory.md"},
)
WITH_FACT = TextNode(
    text="Quillfeather Aerospace was founded in 1994 by Ottoline Varga, a physicist.",
    id_="history",
    metadata={"source": "history.md"},
)
FACT = "Ottoline Varga"
TOKENS = 22


def _nodes(*nodes: TextNode) -> list[NodeWithScore]:
    return [NodeWithScore(node=n) for n in nodes]  # no scores: decoded in this order


def _cited_node(response) -> str:
    """The node the spans over the answer's fact are cited to (most of its characters)."""
    spans = response.metadata["citations"]
    text = "".join(s["text"] for s in spans)
    assert text == str(response) or text.strip() == str(response).strip()
    at = text.find(FACT)
    assert at >= 0, f"the answer lacks the fact: {text!r}"
    votes: dict[str, int] = {}
    pos = 0
    for s in spans:
        overlap = min(pos + len(s["text"]), at + len(FACT)) - max(pos, at)
        if overlap > 0:
            node = s["metadata"].get("node_id")
            votes[node] = votes.get(node, 0) + overlap
        pos += len(s["text"])
    return max(votes, key=votes.__getitem__)


def _check(response, order: list[TextNode]) -> None:
    """The fact is cited to ``WITH_FACT`` at its place in ``order``, which leads the sources."""
    assert _cited_node(response) == WITH_FACT.node_id
    holder = [n.node_id for n in order].index(WITH_FACT.node_id)
    spans = response.metadata["citations"]
    assert any(s["passage"] == holder and s["source"] == "history.md" for s in spans)
    assert [n.node.node_id for n in response.source_nodes] == ["history", "factory"]
    shares = response.metadata["contributions"]
    assert shares[0]["node_id"] == "history" and shares[0]["share"] > 0.5


@pytest.fixture(scope="module")
def synth(lm):
    return TokRAGSynthesizer(lm, max_new_tokens=TOKENS)


@pytest.mark.parametrize("order", [[ON_TOPIC, WITH_FACT], [WITH_FACT, ON_TOPIC]])
def test_synthesizer_cites_the_fact_to_its_node_in_either_order(synth, order):
    _check(synth.synthesize(QUESTION, _nodes(*order)), order)


async def test_synthesizer_streams_and_awaits_the_same_citations(lm, synth):
    order = [ON_TOPIC, WITH_FACT]
    streaming = TokRAGSynthesizer(lm, max_new_tokens=TOKENS, streaming=True)
    r = streaming.synthesize(QUESTION, _nodes(*order))
    assert "citations" not in r.metadata
    assert [n.node.node_id for n in r.source_nodes] == ["factory", "history"]  # not read yet
    text = "".join(r.response_gen)
    assert "".join(s["text"] for s in r.metadata["citations"]) == text
    r.response_txt = text
    _check(r, order)
    a = await synth.asynthesize(QUESTION, _nodes(*order))
    _check(a, order)
    assert a.metadata["citations"] == r.metadata["citations"]


def test_citations_off_and_policy_without_rag_context_give_none(lm):
    nodes = _nodes(ON_TOPIC, WITH_FACT)
    for kw in ({"citations": False}, {"policy": "no_rag"}):
        r = TokRAGSynthesizer(lm, max_new_tokens=3, **kw).synthesize(QUESTION, nodes)
        assert r.metadata["citations"] == [] and r.metadata["contributions"] == []
        assert [n.node.node_id for n in r.source_nodes] == ["factory", "history"]
    with pytest.raises(TypeError, match="citations"):
        TokRAGSynthesizer(lm, citations="yes")


@pytest.fixture
def settings_llm(lm):
    old = Settings._llm
    Settings.llm = TokRAGLLM(lm, max_new_tokens=TOKENS)
    yield Settings.llm
    Settings._llm = old


def test_settings_llm_cites_each_node_in_either_order(settings_llm):
    """LlamaIndex's own synthesizers format the nodes into ``context_str``; each node's text
    there is its own passage. The on-topic node first (a synthesizer given the nodes), then
    the node with the fact first (a stock query engine: it retrieves that one first)."""
    order = [ON_TOPIC, WITH_FACT]
    r = get_response_synthesizer(llm=settings_llm).synthesize(QUESTION, _nodes(*order))
    assert r.metadata["policy_used"] == "tokrag"
    _check(r, order)
    index = VectorStoreIndex([ON_TOPIC, WITH_FACT], embed_model=local_embedding())
    order = [n.node for n in index.as_retriever(similarity_top_k=2).retrieve(QUESTION)]
    assert [n.node_id for n in order] == ["history", "factory"]
    r = index.as_query_engine(similarity_top_k=2).query(QUESTION)
    _check(r, order)
    streamed = index.as_query_engine(similarity_top_k=2, streaming=True).query(QUESTION)
    assert "citations" not in streamed.metadata  # LlamaIndex calls the model at the first read
    assert "".join(streamed.response_gen) == str(r)
    assert streamed.metadata["citations"] == r.metadata["citations"]
    assert [n.node.node_id for n in streamed.source_nodes] == ["history", "factory"]
