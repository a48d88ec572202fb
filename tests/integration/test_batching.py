"""Micro-batching of concurrent calls (tokrag_integrations.batching) on the packaged model:
concurrent calls are decoded together and each gets exactly what it gets alone."""

from __future__ import annotations

import asyncio

import pytest

from tokrag_integrations.batching import batcher_for
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)

N_TOKENS = 8


@pytest.fixture(scope="module")
def questions_and_passages():
    ret = build_retriever(get_sample_docs_path(), "bm25")
    qs = [q["question"] for q in get_sample_questions()][:8]
    return [(q, [h.text for h in ret.retrieve(q, top_k=2)]) for q in qs]


def _content(msg):
    return msg.content, msg.response_metadata["token_ids"]


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_langchain_abatch_equals_invokes_and_batches(lm, questions_and_passages, policy):
    from langchain_core.messages import HumanMessage

    from tokrag_integrations.langchain import ChatTokRAG

    chat = ChatTokRAG(model=lm, policy=policy, max_tokens=N_TOKENS)
    alone = ChatTokRAG(model=lm, policy=policy, max_tokens=N_TOKENS, batching=False)
    inputs = [[HumanMessage(q)] for q, _ in questions_and_passages]
    passages = [p for _, p in questions_and_passages]
    one_by_one = [_content(alone.invoke(m, passages=p)) for m, p in zip(inputs, passages, strict=True)]

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
    bound = [chat.bind(passages=p) for p in passages]
    from langchain_core.runnables import RunnableParallel

    par = RunnableParallel({str(i): r for i, r in enumerate(bound)})
    outs = par.invoke(inputs[0])  # same question to every binding: 8 concurrent invokes
    first = [_content(outs[str(i)]) for i in range(len(bound))]
    expect = [_content(alone.invoke(inputs[0], passages=p)) for p in passages]
    assert first == expect
    assert b.batched_calls > before


def test_one_bad_input_gets_its_error_and_the_others_their_answers(lm, questions_and_passages):
    from tokrag_integrations.langchain import ChatTokRAG

    chat = ChatTokRAG(model=lm, policy="rag", max_tokens=N_TOKENS)
    (q1, p1), (q2, p2) = questions_and_passages[:2]
    expect = [chat.invoke(q, passages=p, config={"configurable": {}}).content for q, p in ((q1, p1), (q2, p2))]

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


def test_llamaindex_concurrent_acomplete_equals_sequential(lm, questions_and_passages):
    from tokrag_integrations.llama_index import TokRAGLLM

    llm = TokRAGLLM(lm, max_new_tokens=N_TOKENS)
    items = questions_and_passages[:4]
    sequential = [llm.complete(q, passages=p).text for q, p in items]
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


def test_chain_abatch_of_8_equals_8_invokes(lm, questions_and_passages):
    from langchain_core.documents import Document
    from langchain_core.runnables import RunnableLambda

    from tokrag_integrations.langchain import create_tokrag_chain

    ret = build_retriever(get_sample_docs_path(), "bm25")
    retriever = RunnableLambda(
        lambda q: [Document(page_content=h.text) for h in ret.retrieve(q, top_k=2)]
    )
    chain = create_tokrag_chain(retriever, lm, max_tokens=N_TOKENS)
    inputs = [{"input": q} for q, _ in questions_and_passages]
    one_by_one = [chain.invoke(x)["answer"] for x in inputs]
    b = batcher_for(lm)
    before = b.batched_calls
    together = [o["answer"] for o in asyncio.run(chain.abatch(inputs))]
    assert together == one_by_one
    assert b.batched_calls - before >= 2
    assert [o["answer"] for o in chain.batch(inputs)] == one_by_one
