"""LangChain adapters on the real default model: ChatTokRAG and create_tokrag_chain.

Retrievers are real: an ``InMemoryVectorStore`` over the packaged MiniLM embeddings and a
``BM25Retriever`` over the sample documents. Answers are short (<= 20 tokens) to keep the
file cheap on CPU.

Cases that need no model, database or server are in ``tests/unit/test_langchain.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
from _helpers import aggregate
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda

from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain, local_embeddings
from tokrag_integrations.retrieval import chunk_documents, get_sample_docs_path, load_documents
from tokrag_integrations.trace import comparable

QUESTION = "What is the code name of the Kestrel-7 programme?"
ANSWER = "Bramblewick"  # appears only in the sample documents
OTHER = "Which Slack channel is used for SEV-1 incidents?"
FACT = Document(
    page_content="The Kestrel-7 programme is known internally by its code name Bramblewick.",
    metadata={"source": "fixture", "score": 0.9},
)


class StaticRetriever(BaseRetriever):
    """Returns fixed documents (for the bad-input cases)."""

    docs: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return list(self.docs)


class FailingRetriever(BaseRetriever):
    """A retriever whose backend is down."""

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        raise ConnectionError("vector database unreachable")


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def docs() -> list[Document]:
    chunks = chunk_documents(load_documents(get_sample_docs_path()), max_chars=400, overlap=0)
    return [
        Document(page_content=c.text, metadata={"source": os.path.basename(c.source)})
        for c in chunks
    ]


@pytest.fixture(scope="module")
def dense(docs: list[Document]) -> BaseRetriever:
    from langchain_core.vectorstores import InMemoryVectorStore

    return InMemoryVectorStore.from_documents(docs, local_embeddings()).as_retriever(
        search_kwargs={"k": 2}
    )


@pytest.fixture(scope="module")
def bm25(docs: list[Document]) -> BaseRetriever:
    from langchain_community.retrievers import BM25Retriever

    return BM25Retriever.from_documents(docs, k=2)


@pytest.fixture(scope="module")
def chat(lm: Any) -> ChatTokRAG:
    return ChatTokRAG(model=lm, max_tokens=6)


@pytest.fixture(scope="module")
def chain(chat: ChatTokRAG) -> Any:
    return create_tokrag_chain(StaticRetriever(docs=[FACT]), chat)


@pytest.fixture(scope="module")
def reference(chain: Any) -> dict[str, dict[str, Any]]:
    """invoke() outputs every equality test compares against (computed once)."""
    return {q: chain.invoke(q) for q in (QUESTION, OTHER)}


def _stable(out: dict[str, Any]) -> dict[str, Any]:
    """An output without the parts that legitimately differ between runs (the trace's
    timings and speed: :func:`~tokrag_integrations.trace.comparable`) and the passed-through
    input keys (``"input"`` for a string, ``"question"`` for such a dict)."""
    trace = comparable(out["trace"])
    rest = {k: v for k, v in out.items() if k not in ("input", "question")}
    return {**rest, "trace": trace}


def _assert_same(got: Any, want: Any, path: str = "out") -> None:
    """Equal structure, equal tokens, texts and decisions; floats equal to 1e-4 relative.

    A batched decode multiplies the same rows in other matrix shapes than a decode of one
    question, so probabilities and signal values may differ in the last float32 digits while
    every token and choice is the same."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6, nan_ok=True), path
    else:
        assert got == want, path


# ------------------------------------------------------------------ pure translation
def test_core_import_does_not_import_langchain() -> None:
    code = (
        "import sys, tokrag_integrations, tokrag_integrations.engine.scheduler, tokrag_integrations.trace;"
        "bad = [m for m in sys.modules if m.startswith(('langchain', 'llama_index'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_policy_option_fails_before_decoding(chat: ChatTokRAG) -> None:
    with pytest.raises(ValueError, match="Unknown policy"):
        chat.invoke("q", passages=["p"], policy="nope")
    with pytest.raises(ValueError, match="Bad options"):
        chat.invoke("q", passages=["p"], policy_options={"no_such_option": 1})


def test_chain_input_validation(chain: Any) -> None:
    with pytest.raises(ValueError, match="'question'"):
        chain.invoke({"q": QUESTION})
    with pytest.raises(ValueError, match="empty"):
        chain.invoke("  ")
    bad = create_tokrag_chain(RunnableLambda(lambda _: "not docs"), ChatTokRAG(model="default"))
    with pytest.raises(TypeError, match="list of langchain_core Documents"):
        bad.invoke(QUESTION)


# ------------------------------------------------------------------ real retrievers
@pytest.mark.parametrize("which", ["dense", "bm25"])
def test_fact_only_in_documents_is_answered(which: str, request: Any, chat: ChatTokRAG) -> None:
    """The 135M model answers this only from the documents (see the pure answer below).

    Policy ``rag``: on a quick sweep of the sample questions the default ``tokrag`` settings
    kept the pure model's answer on this model (reported to the lead); the trace still shows
    the retrieved tokens.
    """
    retriever = request.getfixturevalue(which)
    out = create_tokrag_chain(retriever, chat, policy="rag", max_tokens=20).invoke(QUESTION)
    assert ANSWER in out["answer"]
    assert out["retrieval_empty"] is False and out["context"]
    trace = out["trace"]
    assert trace["policy"] == "rag"
    assert trace["counts"].get("rag", 0) == len(trace["steps"]) > 0
    assert out["sources"] == [s["source"] for s in trace["steps"]]
    kept = [p for p in trace["passages"] if p["kept"]]
    assert [p["text"] for p in kept] == [d.page_content for d in out["context"]]
    assert any(ANSWER in p["text"] for p in kept)


def test_tokrag_trace_shows_retrieval_tokens(reference: dict[str, dict[str, Any]]) -> None:
    out = reference[QUESTION]
    trace = out["trace"]
    assert trace["policy"] == "tokrag"
    assert trace["prompt_tokens"]["rag"] > trace["prompt_tokens"]["pure"]
    assert trace["passages"][0]["kept"] and trace["passages"][0]["metadata"]["source"] == "fixture"
    assert set(out["sources"]) <= {"agree", "rag", "pure"}
    step = trace["steps"][0]
    assert set(step["candidates"]) == {"pure", "rag"}


# ------------------------------------------------------------------ equalities (chain)
def test_chain_stream_equals_invoke(chain: Any, reference: dict[str, dict[str, Any]]) -> None:
    chunks = list(chain.stream(QUESTION))
    assert set(chunks[0]) == {"input", "context", "retrieval_empty"}
    assert set(chunks[-1]) == {"trace", "citations", "warnings"}
    middle = chunks[1:-1]
    assert middle and all("answer" in c for c in middle)
    assert all(
        c["sources"] == [s] for c, s in zip(middle, reference[QUESTION]["sources"], strict=False)
    )
    assert _stable(aggregate(chunks)) == _stable(reference[QUESTION])


async def test_chain_async_equals_sync(chain: Any, reference: dict[str, dict[str, Any]]) -> None:
    out = await chain.ainvoke({"question": QUESTION})
    assert _stable(out) == _stable(reference[QUESTION])
    chunks = [c async for c in chain.astream(QUESTION)]
    assert _stable(aggregate(chunks)) == _stable(reference[QUESTION])


def test_chain_batch_equals_one_by_one(chain: Any, reference: dict[str, dict[str, Any]]) -> None:
    outs = chain.batch([QUESTION, {"question": OTHER}])
    _assert_same([_stable(o) for o in outs], [_stable(reference[q]) for q in (QUESTION, OTHER)])


async def test_chain_abatch_equals_one_by_one(
    chain: Any, reference: dict[str, dict[str, Any]]
) -> None:
    outs = await chain.abatch([QUESTION, OTHER])
    _assert_same([_stable(o) for o in outs], [_stable(reference[q]) for q in (QUESTION, OTHER)])


# ------------------------------------------------------------------ ChatTokRAG
def test_chat_stream_async_batch_agree(chat: ChatTokRAG) -> None:
    import asyncio

    bound = chat.bind(passages=[FACT])
    msg = bound.invoke(QUESTION)
    assert msg.content and msg.usage_metadata["output_tokens"] == len(
        msg.response_metadata["token_sources"]
    )
    # tokrag prefills both contexts: both are counted.
    prompt_tokens = msg.response_metadata["prompt_tokens"]
    assert msg.usage_metadata["input_tokens"] == prompt_tokens["rag"] + prompt_tokens["pure"]
    assert prompt_tokens["pure"] > 0 and prompt_tokens["rag"] > prompt_tokens["pure"]
    assert msg.response_metadata["model_name"] == "SmolLM2-135M-Instruct"
    assert chat.invoke(QUESTION, passages=[FACT]).content == msg.content

    chunks = list(bound.stream(QUESTION))
    tokens = [c for c in chunks if c.response_metadata.get("token_sources")]
    assert all(len(c.response_metadata["token_sources"]) == 1 for c in tokens)
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == msg.content
    assert full.response_metadata["token_sources"] == msg.response_metadata["token_sources"]
    assert full.usage_metadata == msg.usage_metadata

    async def run() -> tuple[Any, str]:
        a = await bound.ainvoke(QUESTION)
        text = "".join([c.content async for c in bound.astream(QUESTION)])
        return a, text

    a, text = asyncio.run(run())
    assert a.content == msg.content == text
    b = bound.batch([QUESTION, QUESTION])
    assert [m.content for m in b] == [msg.content, msg.content]


def test_chat_stop_and_max_tokens(chat: ChatTokRAG) -> None:
    free = chat.invoke("Count from one to ten.", max_tokens=3)
    assert free.usage_metadata["output_tokens"] == 3
    assert free.response_metadata["finish_reason"] == "length"
    word = free.content.split()[0] if free.content.split() else free.content
    cut = chat.invoke("Count from one to ten.", stop=[word], max_tokens=3)
    assert word not in cut.content
    assert cut.response_metadata["stop_reason"] in ("stop", "length", "eos")


def test_chat_pure_without_passages(chat: ChatTokRAG) -> None:
    msg = chat.invoke([SystemMessage("Answer briefly."), HumanMessage(QUESTION)], max_tokens=12)
    assert msg.response_metadata["policy"] == "no_rag"
    assert set(msg.response_metadata["token_sources"]) == {"pure"}
    assert ANSWER not in msg.content  # the fact is only in the documents


# ------------------------------------------------------------------ bad input
def test_empty_retrieval_answers_from_pure_context(chat: ChatTokRAG) -> None:
    chain = create_tokrag_chain(StaticRetriever(docs=[]), chat)
    with pytest.warns(UserWarning, match="returned no documents"):
        out = chain.invoke(QUESTION)
    assert out["retrieval_empty"] is True and out["context"] == []
    assert any("pure context" in w for w in out["warnings"])
    assert set(out["sources"]) == {"pure"}
    assert out["answer"] == chat.invoke(QUESTION).content


def test_empty_documents_are_skipped_with_warning(chat: ChatTokRAG) -> None:
    docs = [Document(page_content="   ", metadata={"source": "blank"}), FACT]
    chain = create_tokrag_chain(StaticRetriever(docs=docs), chat, policy="rag", max_tokens=3)
    with pytest.warns(UserWarning, match="passage 0 is empty"):
        out = chain.invoke(QUESTION)
    assert any("passage 0 is empty" in w for w in out["warnings"])
    assert [p["kept"] for p in out["trace"]["passages"]] == [False, True]
    assert out["context"] == docs and out["retrieval_empty"] is False


def test_too_many_documents_drop_lowest_ranked(chat: ChatTokRAG) -> None:
    filler = "The canteen serves soup on Tuesdays and fish on Fridays. " * 6
    docs = [FACT] + [Document(page_content=f"{i}: {filler}") for i in range(4)]
    chain = create_tokrag_chain(
        StaticRetriever(docs=docs), chat, policy="rag", max_tokens=3, max_context_tokens=220
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = chain.invoke(QUESTION)
    assert any("dropped lowest-ranked" in str(w.message) for w in caught)
    assert any("dropped lowest-ranked" in w for w in out["warnings"])
    kept = [p["kept"] for p in out["trace"]["passages"]]
    assert kept[0] is True and kept[-1] is False
    assert kept == sorted(kept, reverse=True)  # drops come from the bottom of the ranking


def test_failing_retriever_propagates_with_context(chat: ChatTokRAG) -> None:
    import asyncio

    chain = create_tokrag_chain(FailingRetriever(), chat)
    with pytest.raises(RuntimeError, match=r"retriever FailingRetriever failed for question") as e:
        chain.invoke(QUESTION)
    assert isinstance(e.value.__cause__, ConnectionError)
    received: list[Any] = []
    with pytest.raises(RuntimeError, match="vector database unreachable"):
        for c in chain.stream(QUESTION):
            received.append(c)
    assert received == []  # nothing half-written

    async def run() -> None:
        with pytest.raises(RuntimeError, match="failed for question"):
            await chain.ainvoke(QUESTION)
        with pytest.raises(RuntimeError, match="failed for question"):
            async for c in chain.astream(QUESTION):
                received.append(c)

    asyncio.run(run())
    assert received == []


# ------------------------------------------------------------------ raw-prompt path
def test_without_passages_formats_like_chat_huggingface(lm: Any) -> None:
    """The chat template over the messages as given: no injected system prompt or QA wording."""
    tok = lm.tokenizer
    seen: list[list[int]] = []

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and not seen:
            seen.append(ids[0].tolist())

    chat = ChatTokRAG(model=lm, max_tokens=3)
    handle = lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        chat.invoke([SystemMessage(content="Be brief."), HumanMessage(content="Say hi.")])
    finally:
        handle.remove()
    want = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    assert seen[0] == list(want)


# ------------------------------------------------------------------ create_retrieval_chain shape
def test_chain_takes_input_and_chat_history_and_streams(lm: Any, chain: Any) -> None:
    """{"input", "chat_history", extra keys} in; input keys + context + answer out; streams."""
    history = [("human", "Remember the word Zanzibarine."), ("ai", "Noted.")]
    payload = {"input": QUESTION, "chat_history": history, "user_id": "u1"}
    seen: list[list[int]] = []

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.append(ids[0].tolist())

    handle = lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = chain.invoke(payload)
    finally:
        handle.remove()
    assert out["input"] == QUESTION and out["user_id"] == "u1" and out["chat_history"] == history
    assert out["context"] == [FACT] and out["answer"].strip()
    # The history reaches the prompt (both contexts are prefilled from it).
    assert any("Zanzibarine" in lm.tokenizer.decode(ids) for ids in seen)

    chunks = list(chain.stream(payload))
    assert chunks[0]["user_id"] == "u1" and chunks[0]["context"] == [FACT]
    assert "".join(c.get("answer", "") for c in chunks) == out["answer"]
    assert chain.invoke({"question": QUESTION})["answer"] == chain.invoke(QUESTION)["answer"]
    assert chain.invoke(QUESTION)["input"] == QUESTION


def test_chain_schemas_are_real(chain: Any) -> None:
    props = chain.get_input_schema().model_json_schema()["properties"]
    assert {"input", "question", "chat_history"} <= set(props)
    out_props = chain.get_output_schema().model_json_schema()["properties"]
    assert {"answer", "context", "sources", "trace", "warnings", "retrieval_empty"} <= set(out_props)
