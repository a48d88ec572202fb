"""Retrieval gating: metric formulas, thresholds, calibration files, GECE, CtrlA, routers.

Cases that need no model, database or server are in ``tests/unit/test_gating.py``."""

from __future__ import annotations

import math

import pytest

from tokrag_integrations.gating import ConfidenceGate


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

    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
    from tokrag_integrations.langchain.gated_router import gated_router

    ret = _retriever()
    lc_ret = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=3, threshold=threshold)
    chat = ChatTokRAG(model=lm, policy="no_rag", max_tokens=6)
    rag = create_tokrag_chain(lc_ret, lm, policy="rag", max_tokens=6, citations=True)
    router = gated_router(gate, chat, rag)
    out = router.invoke({"question": "Who founded Quillfeather Aerospace?"})
    assert out["route"] == route and out["gate"]["retrieve"] == (route == "rag")
    assert isinstance(out["answer"], str) and "score" in out["gate"]
    # The RAG branch's citations (asked for: policy rag); none from the plain model.
    cited = [c["passage"] for c in out["citations"]]
    assert cited and None not in cited if route == "rag" else cited == []


@pytest.mark.parametrize("threshold, route", [(math.inf, "rag"), (-math.inf, "direct")])
def test_langchain_router_streams_and_awaits_the_chosen_branch(lm, threshold, route):
    """stream/astream go through the chosen branch's own stream (several answer chunks,
    adding up to invoke's answer); ainvoke equals invoke; the branch runs as a child of
    the router's run in LangChain tracing."""
    import asyncio

    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda
    from langchain_core.tracers.context import collect_runs

    from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain
    from tokrag_integrations.langchain.gated_router import gated_router

    ret = _retriever()
    lc_ret = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=3, threshold=threshold)
    chat = ChatTokRAG(model=lm, policy="no_rag", max_tokens=8)
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

    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer
    from tokrag_integrations.llama_index.gated_engine import gate_selector, gated_query_engine

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


def test_gece_samples_are_transformers_sampling_on_the_engine(lm):
    """GECE's self-mode references are decoded on the engine's step loop (no model.generate
    in the package) and are the answers transformers' own sampling gives for the same seed:
    temperature and top-p warpers, one joint draw over the n rows per step."""
    import zlib

    import torch

    from tokrag_integrations.gating.gece import GECEGate, _pure_ids

    g = GECEGate(lm, n_samples=3, max_new_tokens=16, sketch_dim=64)
    for q in ("Who wrote Hamlet?", "What is the tallest mountain?"):
        got = g.samples(q)
        inp = torch.tensor([_pure_ids(lm, q, 16)], dtype=torch.long)
        torch.manual_seed(g.seed + zlib.crc32(q.encode("utf-8")))
        with torch.inference_mode():
            out = lm.model.generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=True,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=0,
                max_new_tokens=16,
                num_return_sequences=3,
                pad_token_id=lm.pad_token_id,
            )
        texts = lm.tokenizer.batch_decode(out[:, inp.shape[1] :], skip_special_tokens=True)
        assert got == [t.split("\n")[0].strip() for t in texts], q
