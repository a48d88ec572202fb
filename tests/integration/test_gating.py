"""Retrieval gating: metric formulas, thresholds, calibration files, GECE, CtrlA, routers."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.engine.stats import distribution_stats
from tokrag_integrations.gating import ConfidenceGate, Gate, GECEGate
from tokrag_integrations.gating.gece import CountSketch, meteor
from tokrag_integrations.gating.metrics import metrics_from_probs, metrics_from_stats


def test_metrics_on_hand_made_distributions():
    # two steps over V = 4: one-hot-ish and uniform
    probs = torch.tensor([[0.5, 0.5, 0.0 + 1e-300, 0.0 + 1e-300], [0.25, 0.25, 0.25, 0.25]])
    m = metrics_from_probs(probs, [0, 3])
    assert m.raw["avg_logp"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2)
    assert m.raw["gini"] == pytest.approx((0.5 + 0.25) / 2)
    assert m.raw["entropy"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert m.raw["dp"] == pytest.approx((2 + 4) / 2)
    # uniform step contributes 0 to Self-Certainty; confidence flips entropy and DP
    assert m.confidence["entropy"] == -m.raw["entropy"]
    assert m.confidence["dp"] == -m.raw["dp"]
    u = metrics_from_probs(torch.full((1, 8), 1 / 8), [2])
    assert u.raw["self_certainty"] == pytest.approx(0.0)


def test_decoder_stats_give_the_same_metrics_as_full_distributions():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    ids = [3, 7, 0, 49, 12]
    steps = [{"stats": {"pure": distribution_stats(logits[i], ids[i])}} for i in range(5)]
    a = metrics_from_stats(steps, 50)
    b = metrics_from_probs(torch.softmax(logits.double(), -1), ids)
    for k in b.raw:
        assert a.raw[k] == pytest.approx(b.raw[k], rel=1e-5, abs=1e-6), k
    assert a.mean_prob == pytest.approx(b.mean_prob, rel=1e-5)


class _TableGate(Gate):
    name = "table"
    retrieve_when = "below"

    def __init__(self, table=None, **kw):
        super().__init__()
        self.table = table or {}

    def score(self, query):
        return self.table[query], {}


def test_decisions_flip_across_calibrated_threshold_and_round_trip(tmp_path):
    table = {f"q{i}": float(i) for i in range(11)}
    g = _TableGate(table)
    with pytest.raises(RuntimeError, match="calibrate"):
        g.decide("q1")
    g.calibrate(list(table), percentile=70)  # 70 % answered without retrieval
    assert g.threshold == pytest.approx(3.0)
    assert g.decide("q2").retrieve and not g.decide("q4").retrieve
    assert sum(g.decide(q).retrieve for q in table) == 3
    path = g.save(tmp_path / "gate.json")
    h = _TableGate.load(path, table=table)
    assert h.threshold == g.threshold and h.percentile == 70
    assert [h.decide(q).retrieve for q in table] == [g.decide(q).retrieve for q in table]
    d = h.decide("q0").to_dict()
    assert d["retrieve"] is True and d["score"] == 0.0 and d["threshold"] == 3.0


def test_meteor_exact_and_stem_stages():
    assert meteor("the cat sat", "the cat sat") == pytest.approx(1 - 0.5 * (1 / 3) ** 3)
    # "cats" matches "cat" at the stem stage; 2 of 3 unigrams match in one chunk
    p, r = 2 / 2, 2 / 3
    f = p * r / (0.9 * p + 0.1 * r)
    assert meteor("black cats", "the black cat") == pytest.approx(f * (1 - 0.5 * (1 / 2) ** 3))
    assert meteor("dog", "cat") == 0.0


def test_gece_reference_mode_matches_hand_computation():
    g = GECEGate.__new__(GECEGate)
    g.mode = "reference"
    g.mean_grad = torch.tensor([1.0, 2.0, 0.0])
    terms = {
        "pred": "Paris",
        "refs": ["Paris"],
        "meteor": meteor("Paris", "Paris"),
        "mean_p": 0.25,
        "alpha": 0.01,
        "grad": torch.tensor([0.5, 0.5, 3.0]),
    }
    val, det = g.gece(terms)
    m = 1 - 0.5  # one word, one chunk: penalty 0.5
    assert det["meteor"] == pytest.approx(m)
    assert val == pytest.approx(abs(m - 0.25) / (0.01 * (0.5 + 1.0)))
    # a non-positive dot product is floored (most long-tail), never flips the sign
    terms["grad"] = torch.tensor([-1.0, 0.0, 0.0])
    assert g.gece(terms)[0] == pytest.approx(abs(m - 0.25) / (0.01 * 1e-3 * 5.0))


def test_count_sketch_preserves_dot_products():
    torch.manual_seed(1)
    a = [torch.randn(200, 300), torch.randn(5000)]
    b = [0.6 * a[0] + 0.8 * torch.randn(200, 300), 0.6 * a[1] + 0.8 * torch.randn(5000)]
    exact = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    sk = CountSketch([x.numel() for x in a], 16384, seed=0)
    approx = float(torch.dot(sk(a).double(), sk(b).double()))
    assert approx == pytest.approx(exact, rel=0.1)


def test_ctrla_directions_separate_held_back_prompts(lm):
    from tokrag_integrations.gating.ctrla import contrast_differences, layer_band, pca_directions
    from tokrag_integrations.gating.statements import STATEMENTS

    assert len(STATEMENTS) >= 60
    fit, held = list(STATEMENTS[:12]), list(STATEMENTS[-8:])  # disjoint; small for CPU time
    v = pca_directions(contrast_differences(lm, fit))
    band = layer_band(lm.num_layers, (0.28, 0.72))
    d = contrast_differences(lm, held)  # r(confident) - r(unconfident), held-back statements
    proj = (d[:, band, :] * v[band]).sum(-1).mean(-1)
    # confident prompt projects higher than its unconfident twin (chance: 50 %)
    assert float((proj > 0).float().mean()) >= 0.75


def test_confidence_gate_scores_from_one_decode(lm, tmp_path):
    g = ConfidenceGate(lm, "dp", max_new_tokens=4)
    s, det = g.score("What is the capital of France?")
    assert s == pytest.approx(det["metrics"]["confidence"]["dp"]) and s < 0
    g.threshold = s + 1.0
    assert g.decide("What is the capital of France?").retrieve
    g.save(tmp_path / "c.json")
    h = ConfidenceGate.load(tmp_path / "c.json", lm)
    assert h.metric == "dp" and h.threshold == g.threshold and h.max_new_tokens == 4


def _retriever():
    from tokrag_integrations.retrieval import build_retriever, get_sample_docs_path

    return build_retriever(get_sample_docs_path(), "bm25")


@pytest.mark.parametrize("threshold, route", [(math.inf, "rag"), (-math.inf, "direct")])
def test_langchain_router_routes_both_ways(lm, threshold, route):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from tokrag_integrations.gating.langchain import gated_router
    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain

    ret = _retriever()
    lc_ret = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=3, threshold=threshold)
    chat = ChatTokRAG(model=lm, policy="llm", max_tokens=6)
    router = gated_router(gate, chat, create_tokrag_chain(lc_ret, lm, policy="rag", max_tokens=6))
    out = router.invoke({"question": "Who founded Quillfeather Aerospace?"})
    assert out["route"] == route and out["gate"]["retrieve"] == (route == "rag")
    assert isinstance(out["answer"], str) and "score" in out["gate"]


@pytest.mark.parametrize("threshold, route", [(math.inf, "rag"), (-math.inf, "direct")])
def test_langchain_router_streams_and_awaits_the_chosen_branch(lm, threshold, route):
    """stream/astream go through the chosen branch's own stream (several answer chunks,
    adding up to invoke's answer); ainvoke equals invoke; the branch runs as a child of
    the router's run in LangChain tracing."""
    import asyncio

    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda
    from langchain_core.tracers.context import collect_runs

    from tokrag_integrations.gating.langchain import gated_router
    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain

    ret = _retriever()
    lc_ret = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=3, threshold=threshold)
    chat = ChatTokRAG(model=lm, policy="llm", max_tokens=8)
    router = gated_router(gate, chat, create_tokrag_chain(lc_ret, lm, policy="rag", max_tokens=8))
    q = {"question": "Who founded Quillfeather Aerospace?"}
    with collect_runs() as cb:
        full = router.invoke(q)
    (run,) = cb.traced_runs
    assert run.name == "GatedRouter" and run.child_runs, "the branch runs under the router's run"
    chunks = list(router.stream(q))
    assert chunks[0]["route"] == route and "score" in chunks[0]["gate"]
    pieces = [c["answer"] for c in chunks[1:]]
    assert len([p for p in pieces if p]) >= 2, "the chosen branch streams token by token"
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total["answer"] == full["answer"] and total["route"] == full["route"] == route

    async def both():
        out = await router.ainvoke(q)
        achunks = [c async for c in router.astream(q)]
        return out, achunks

    aout, achunks = asyncio.run(both())
    assert aout["answer"] == full["answer"] and aout["route"] == route
    assert "".join(c.get("answer", "") for c in achunks) == full["answer"]


@pytest.mark.parametrize("threshold, route", [(math.inf, "rag"), (-math.inf, "direct")])
def test_llamaindex_router_routes_both_ways(lm, threshold, route):
    import json

    from llama_index.core.query_engine import RouterQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode
    from llama_index.core.tools import QueryEngineTool

    from tokrag_integrations.gating.llama_index import gate_selector, gated_query_engine
    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    ret = _retriever()

    class _R(BaseRetriever):
        def _retrieve(self, qb):
            return [
                NodeWithScore(node=TextNode(text=h.text), score=h.score)
                for h in ret.retrieve(qb.query_str, top_k=2)
            ]

    class _Empty(BaseRetriever):
        def _retrieve(self, qb):
            return []

    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=3, threshold=threshold)
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=6)
    from llama_index.core.query_engine import RetrieverQueryEngine

    direct = RetrieverQueryEngine(retriever=_Empty(), response_synthesizer=synth)
    rag = RetrieverQueryEngine(retriever=_R(), response_synthesizer=synth)
    router = RouterQueryEngine(
        selector=gate_selector(gate),
        llm=TokRAGLLM(lm),  # else LlamaIndex resolves Settings.llm (OpenAI) at construction
        query_engine_tools=[
            QueryEngineTool.from_defaults(direct, description="answer from the model alone"),
            QueryEngineTool.from_defaults(rag, description="answer from retrieved passages"),
        ],
    )
    q = "Who founded Quillfeather Aerospace?"
    resp = router.query(q)
    reason = json.loads(resp.metadata["selector_result"].selections[0].reason)
    assert reason["route"] == route and "score" in reason
    gated = gated_query_engine(gate, _R(), synth).query(q)
    assert gated.metadata["route"] == route and gated.metadata["gate"]["retrieve"] == (
        route == "rag"
    )
    assert bool(gated.source_nodes) == (route == "rag")


def test_gated_query_engine_keeps_the_callers_callback_manager() -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core import Settings
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    from tokrag_integrations.gating.llama_index import gated_query_engine

    mine = CallbackManager([TokenCountingHandler()])
    assert gated_query_engine(None, None, None, callback_manager=mine).callback_manager is mine
    assert gated_query_engine(None, None, None).callback_manager is Settings.callback_manager
