"""Micro-batching of concurrent calls (tokrag_integrations.engine.scheduler) on the packaged model:
concurrent calls are decoded together and each gets exactly what it gets alone.

Each input is decoded alone once (the module's ``solo`` fixture, through ``ChatTokRAG`` with
batching off); every batched mode (LangChain ``abatch`` and parallel branches, LlamaIndex
``acomplete``, the chain's ``batch`` and ``abatch``) is compared against that reference:
the chat model, the chain without a prompt and ``TokRAGLLM`` build the same prompt from the
same passages, which the first test checks for one input."""

from __future__ import annotations

import asyncio

import pytest

from tokrag_integrations.engine.scheduler import batcher_for
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)

N_TOKENS = 8
#: The secondary modes (parallel branches, rag, the chain's batch) batch this many inputs: a
#: batched decode costs about as much CPU as its rows decoded alone, and 4 rows take the same
#: code path as 8.
FEW = 4


@pytest.fixture(scope="module")
def questions_and_passages():
    ret = build_retriever(get_sample_docs_path(), "bm25")
    qs = [q["question"] for q in get_sample_questions()][:8]
    return [(q, [h.text for h in ret.retrieve(q, top_k=2)]) for q in qs]


def _content(msg):
    return msg.content, msg.response_metadata["token_ids"]


@pytest.fixture(scope="module")
def solo(lm, questions_and_passages):
    """policy -> [(content, token_ids)] of each input decoded alone (batching off)."""
    from langchain_core.messages import HumanMessage

    from tokrag_integrations.langchain import ChatTokRAG

    out = {}
    for policy, n in (("tokrag", len(questions_and_passages)), ("rag", FEW)):
        alone = ChatTokRAG(model=lm, policy=policy, max_tokens=N_TOKENS, batching=False)
        out[policy] = [
            _content(alone.invoke([HumanMessage(q)], passages=p))
            for q, p in questions_and_passages[:n]
        ]
    return out


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_langchain_abatch_equals_invokes_and_batches(lm, questions_and_passages, solo, policy):
    from langchain_core.messages import HumanMessage

    from tokrag_integrations.langchain import ChatTokRAG

    chat = ChatTokRAG(model=lm, policy=policy, max_tokens=N_TOKENS)
    one_by_one = solo[policy]
    inputs = [[HumanMessage(q)] for q, _ in questions_and_passages][: len(one_by_one)]
    passages = [p for _, p in questions_and_passages][: len(one_by_one)]

    b = batcher_for(lm)
    before = (b.batches, b.batched_calls)

    async def run():
        return await asyncio.gather(
            *(chat.ainvoke(m, passages=p) for m, p in zip(inputs, passages, strict=True))
        )

    together = [_content(m) for m in asyncio.run(run())]
    assert together == one_by_one
    assert b.batches > before[0] and b.batched_calls - before[1] >= 2, "nothing was batched"

    if policy != "tokrag":
        return
    # sync concurrency (a thread per branch) batches too and gives the same answers
    before = b.batched_calls
    from langchain_core.runnables import RunnableLambda, RunnableParallel

    branches = [
        RunnableLambda(lambda _, m=m: m) | chat.bind(passages=p)
        for m, p in zip(inputs[:FEW], passages[:FEW], strict=True)
    ]
    par = RunnableParallel({str(i): r for i, r in enumerate(branches)})
    outs = par.invoke(None)  # each branch its own input: FEW concurrent invokes
    assert [_content(outs[str(i)]) for i in range(len(branches))] == one_by_one[:FEW]
    assert b.batched_calls > before

    # The other entry points build the same prompt from the same passages.
    from tokrag_integrations.llama_index import TokRAGLLM

    (q, p), (text, _) = questions_and_passages[0], one_by_one[0]
    assert TokRAGLLM(lm, max_new_tokens=N_TOKENS, batching=False).complete(q, passages=p).text == text


def test_one_bad_input_gets_its_error_and_the_others_their_answers(lm, questions_and_passages, solo):
    from tokrag_integrations.langchain import ChatTokRAG

    chat = ChatTokRAG(model=lm, policy="rag", max_tokens=N_TOKENS)
    (q1, p1), (q2, p2) = questions_and_passages[:2]
    expect = [content for content, _ in solo["rag"][:2]]

    async def run():
        return await asyncio.gather(
            chat.ainvoke(q1, passages=p1),
            chat.ainvoke("   ", passages=p1),  # an empty question: refused before decoding
            chat.ainvoke(q2, passages=p2),
            return_exceptions=True,
        )

    a, bad, c = asyncio.run(run())
    assert isinstance(bad, ValueError) and "empty" in str(bad).lower()
    assert [a.content, c.content] == expect


def test_llamaindex_concurrent_acomplete_equals_sequential(lm, questions_and_passages, solo):
    from tokrag_integrations.llama_index import TokRAGLLM

    llm = TokRAGLLM(lm, max_new_tokens=N_TOKENS)
    items = questions_and_passages[:4]
    sequential = [content for content, _ in solo["tokrag"][:4]]
    b = batcher_for(lm)
    before = b.batched_calls

    async def run():
        return await asyncio.gather(*(llm.acomplete(q, passages=p) for q, p in items))

    assert [r.text for r in asyncio.run(run())] == sequential
    assert b.batched_calls > before


def test_llamaindex_concurrent_aquery_is_batched(lm):
    from llama_index.core.schema import NodeWithScore, TextNode

    from tokrag_integrations.llama_index import TokRAGSynthesizer

    nodes = [
        NodeWithScore(node=TextNode(text="Quillfeather Aerospace was founded by Ottoline Varga."), score=1.0)
    ]
    qs = ["Who founded Quillfeather Aerospace?", "Who is the founder of Quillfeather?"]
    synth = TokRAGSynthesizer(lm, max_new_tokens=N_TOKENS)
    alone = TokRAGSynthesizer(lm, max_new_tokens=N_TOKENS, batching=False)
    sequential = [str(alone.synthesize(q, nodes)) for q in qs]
    b = batcher_for(lm)
    before = b.batched_calls

    async def run():
        return await asyncio.gather(*(synth.asynthesize(q, nodes) for q in qs))

    assert [str(r) for r in asyncio.run(run())] == sequential
    assert b.batched_calls > before


def test_chain_abatch_and_batch_equal_invokes(lm, questions_and_passages, solo):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from tokrag_integrations.langchain import create_tokrag_chain

    ret = build_retriever(get_sample_docs_path(), "bm25")
    retriever = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    chain = create_tokrag_chain(retriever, lm, max_tokens=N_TOKENS)
    inputs = [{"input": q} for q, _ in questions_and_passages[:FEW]]
    one_by_one = [content for content, _ in solo["tokrag"][:FEW]]
    assert chain.invoke(inputs[0])["answer"] == one_by_one[0]
    b = batcher_for(lm)
    before = b.batched_calls
    together = [o["answer"] for o in asyncio.run(chain.abatch(inputs))]
    assert together == one_by_one
    assert b.batched_calls - before >= 2
    assert [o["answer"] for o in chain.batch(inputs)] == one_by_one
