"""Tok-RAG on a LangChain user's own prompt (issue 27, LangChain half).

``create_tokrag_chain(retriever, model, prompt=...)`` and ``create_tokrag_documents_chain``
take the ``ChatPromptTemplate`` a user gives ``create_stuff_documents_chain``: the RAG context
is that prompt as formatted, its retrieved tokens are where ``{context}`` lands. ``ChatTokRAG``
called without passages and with no retriever in its run (``prompt | ChatTokRAG |
StrOutputParser`` over text put in by hand) is the plain model and warns once per instance
(LangChain's own RAG recipes, with a retriever: ``test_langchain_retrieved.py``). Real default model, real BM25 retriever over the sample documents,
answers of at most 16 tokens.

Cases that need no model, database or server are in ``tests/unit/test_langchain_templates.py``."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
from _helpers import aggregate, forward_inputs
from langchain_core.documents import Document
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnablePassthrough

from tokrag_integrations.langchain import (
    ChatTokRAG,
    create_tokrag_chain,
    create_tokrag_documents_chain,
)
from tokrag_integrations.langchain.calls import NO_PASSAGES_WARNING
from tokrag_integrations.langchain.tokrag_chain import format_documents
from tokrag_integrations.retrieval import chunk_documents, get_sample_docs_path, load_documents
from tokrag_integrations.trace import comparable

QUESTION = "Who founded Quillfeather Aerospace?"
ANSWER = "Ottoline Varga"  # only in the sample documents
#: The wording of LangChain's RAG tutorials: the documents in the system message.
SYSTEM = "Use the following pieces of retrieved context to answer the question.\n\n{context}"
PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])


def _prefill_text(lm: Any, call: Any) -> str:
    """The text of the first forward pass of ``lm.model`` while ``call()`` runs: every
    context of the decode, whether packed into one sequence or fused as rows of a batch."""
    return "".join(lm.tokenizer.decode(row) for row in forward_inputs(lm, call)[0])


def _chat_ids(lm: Any, messages: list[Any]) -> list[int]:
    turns = [
        {"role": {"human": "user", "ai": "assistant"}.get(m.type, m.type), "content": m.content}
        for m in messages
    ]
    out = lm.tokenizer.apply_chat_template(
        turns, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    return list(out["input_ids"])


def _stable(out: dict[str, Any]) -> dict[str, Any]:
    """The output without the trace's timings and speed (they differ from run to run:
    :func:`~tokrag_integrations.trace.comparable`)."""
    return {**out, "trace": comparable(out["trace"])}


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def bm25() -> Any:
    """BM25 over the packaged sample documents; its best chunk holds the founder's name."""
    from langchain_community.retrievers import BM25Retriever

    chunks = chunk_documents(load_documents(get_sample_docs_path()), max_chars=400, overlap=0)
    docs = [
        Document(page_content=c.text, metadata={"source": os.path.basename(c.source)})
        for c in chunks
    ]
    return BM25Retriever.from_documents(docs, k=1)


@pytest.fixture(scope="module")
def chat(lm: Any) -> ChatTokRAG:
    return ChatTokRAG(model=lm, max_tokens=16)


@pytest.fixture(scope="module")
def chain(bm25: Any, chat: ChatTokRAG) -> Any:
    return create_tokrag_chain(bm25, chat, prompt=PROMPT)


@pytest.fixture(scope="module")
def templated(lm: Any, chain: Any) -> dict[str, Any]:
    """The chain's invoke() output and the text of its first forward pass (computed once)."""
    box: dict[str, Any] = {}
    box["prefill"] = _prefill_text(
        lm, lambda: box.setdefault("out", chain.invoke({"input": QUESTION}))
    )
    return box


# ------------------------------------------------------------------ create_tokrag_chain(prompt=)
def test_user_prompt_is_decoded_with_tokrag(lm: Any, templated: dict[str, Any]) -> None:
    out = templated["out"]
    assert ANSWER in out["answer"]
    trace = out["trace"]
    assert trace["policy"] == "tokrag"
    assert trace["counts"].get("rag", 0) > 0  # tokens taken from the retrieved context
    assert out["sources"] == [s["source"] for s in trace["steps"]]
    assert set(out) >= {"input", "context", "answer", "trace", "warnings", "retrieval_empty"}
    assert out["input"] == QUESTION and out["context"] and out["retrieval_empty"] is False
    # The RAG context is the user's prompt exactly as formatted, and it reached the decoder
    # (as text: the core encodes it in three segments, before / the context / after, so a
    # boundary may tokenize differently, e.g. "\n\n" as one token instead of two; and the
    # first forward may pack both contexts into one sequence).
    context = format_documents(out["context"])
    want = _chat_ids(lm, PROMPT.invoke({"context": context, "input": QUESTION}).to_messages())
    prefill = templated["prefill"]
    assert lm.tokenizer.decode(want) in prefill
    assert abs(trace["prompt_tokens"]["rag"] - len(want)) <= 2
    # Its one retrieved span is the {context} text.
    (passage,) = trace["passages"]
    assert passage["text"] == context and passage["kept"] and not passage["cut"]
    assert passage["n_tokens"] == len(lm.tokenizer(context, add_special_tokens=False).input_ids)
    # The pure context is the question alone: the template's wording is in the RAG one only.
    assert prefill.count("Use the following pieces") == 1
    assert prefill.count(ANSWER) == context.count(ANSWER)


def test_user_prompt_stream_and_async_give_the_same_tokens(
    chain: Any, templated: dict[str, Any]
) -> None:
    import asyncio

    want = _stable(templated["out"])
    chunks = list(chain.stream({"input": QUESTION}))
    assert set(chunks[0]) == {"input", "context", "retrieval_empty"}
    assert set(chunks[-1]) == {"trace", "citations", "warnings"}
    assert _stable(aggregate(chunks)) == want

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        out = await chain.ainvoke({"input": QUESTION})
        return out, [c async for c in chain.astream({"input": QUESTION})]

    out, achunks = asyncio.run(run())
    assert _stable(out) == want
    assert _stable(aggregate(achunks)) == want


def test_chat_history_fills_the_prompt_and_the_pure_context(lm: Any, bm25: Any) -> None:
    """A MessagesPlaceholder receives chat_history; the pure context keeps those turns."""
    prompt = ChatPromptTemplate.from_messages(
        [("system", SYSTEM), MessagesPlaceholder("chat_history"), ("human", "{input}")]
    )
    chain = create_tokrag_chain(bm25, ChatTokRAG(model=lm, max_tokens=2), prompt=prompt)
    history = [("human", "Remember the word Zanzibarine."), ("ai", "Noted.")]
    prefill = _prefill_text(lm, lambda: chain.invoke({"input": QUESTION, "chat_history": history}))
    # In both contexts: the RAG one (the formatted prompt) and the pure one (the question
    # after the conversation).
    assert prefill.count("Zanzibarine") == 2
    assert prefill.count("Use the following pieces") == 1


# ------------------------------------------------------------------ documents chain
def test_documents_chain_gives_the_retrieval_chains_answer(
    chat: ChatTokRAG, bm25: Any, templated: dict[str, Any]
) -> None:
    import asyncio

    docs = bm25.invoke(QUESTION)
    answer = create_tokrag_documents_chain(chat, PROMPT)
    payload = {"context": docs, "input": QUESTION}
    want = templated["out"]["answer"]
    assert answer.invoke(payload) == want
    assert "".join(answer.stream(payload)) == want

    async def run() -> str:
        return "".join([c async for c in answer.astream(payload)])

    assert asyncio.run(run()) == want
    # create_retrieval_chain's composition around it (here returning the AIMessage, with
    # output_parser=RunnablePassthrough(): its metadata carries the policy and the trace).
    message = create_tokrag_documents_chain(chat, PROMPT, output_parser=RunnablePassthrough())
    composed = RunnablePassthrough.assign(context=(lambda x: x["input"]) | bm25).assign(
        answer=message
    )
    out = composed.invoke({"input": QUESTION})
    assert out["context"] == docs
    msg = out["answer"]
    assert isinstance(msg, AIMessage) and msg.content == want
    assert msg.response_metadata["policy"] == "tokrag"
    assert msg.response_metadata["counts"] == templated["out"]["trace"]["counts"]


def test_documents_chain_without_prompt_uses_the_passages(lm: Any) -> None:
    chat = ChatTokRAG(model=lm, max_tokens=3)
    fact = Document(page_content="Quillfeather Aerospace was founded by Ottoline Varga.")
    got = create_tokrag_documents_chain(chat).invoke({"context": [fact], "question": QUESTION})
    want = chat.invoke(QUESTION, passages=[fact]).content
    assert got == want


def test_prompt_is_validated(chat: ChatTokRAG, bm25: Any) -> None:
    no_context = ChatPromptTemplate.from_messages([("human", "{input}")])
    with pytest.raises(ValueError, match=r"must take \{context\}"):
        create_tokrag_chain(bm25, chat, prompt=no_context)
    with pytest.raises(ValueError, match=r"must take \{context\}"):
        create_tokrag_documents_chain(chat, no_context)
    with pytest.raises(TypeError, match="prompt template"):
        create_tokrag_chain(bm25, chat, prompt="{context} {input}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="put the system message in your prompt"):
        create_tokrag_chain(bm25, chat, prompt=PROMPT, system_prompt="Be brief.")
    answer = create_tokrag_documents_chain(chat, PROMPT)
    with pytest.raises(TypeError, match="list of langchain_core Documents"):
        answer.invoke({"context": "not documents", "input": QUESTION})
    with pytest.raises(ValueError, match="'context'"):
        answer.invoke({"input": QUESTION})


# ------------------------------------------------------------------ ChatTokRAG without passages
def test_lcel_prompt_into_chat_warns_once_and_reports_llm(lm: Any) -> None:
    """``ChatPromptTemplate | ChatTokRAG | StrOutputParser`` with the documents written into
    the prompt by hand (no ``context`` / ``documents`` variable, no retriever): the plain
    model, said once per instance; asking for policy="no_rag" says nothing. The same text given
    to the prompt's ``context`` variable is retrieved text (issue 57, item 5)."""
    import asyncio

    handmade = ChatPromptTemplate.from_messages(
        [("system", "Quillfeather was founded by Ottoline Varga."), ("human", "{input}")]
    )
    prompt_value = {"input": QUESTION}
    chat = ChatTokRAG(model=lm, max_tokens=2)
    lcel = handmade | chat | StrOutputParser()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lcel.invoke(prompt_value)
        "".join(lcel.stream(prompt_value))
        asyncio.run(lcel.ainvoke(prompt_value))
        msg = (handmade | chat).invoke(prompt_value)
        ours = [w for w in caught if str(w.message) == NO_PASSAGES_WARNING]
        assert len(ours) == 1 and issubclass(ours[0].category, UserWarning)
        assert ours[0].filename == __file__  # the warning points at the user's call
        assert msg.response_metadata["policy"] == "no_rag"
        assert set(msg.response_metadata["token_sources"]) == {"pure"}
        assert msg.response_metadata["counts"] == {"pure": 2}
        assert msg.response_metadata["retrieval"]["source"] == "none"  # said on every call

        (handmade | ChatTokRAG(model=lm, max_tokens=1)).invoke(prompt_value)  # a new instance
        ours = [w for w in caught if str(w.message) == NO_PASSAGES_WARNING]
        assert len(ours) == 2

        caught.clear()
        ChatTokRAG(model=lm, max_tokens=1).invoke(QUESTION, policy="no_rag")
        ChatTokRAG(model=lm, max_tokens=1, policy="no_rag").invoke(QUESTION)
        ChatTokRAG(model=lm, max_tokens=1).invoke(QUESTION, passages=[])  # explicit: empty
        filled = {"context": "Quillfeather was founded by Ottoline Varga.", "input": QUESTION}
        meta = (PROMPT | chat).invoke(filled).response_metadata
        assert meta["policy"] == "tokrag" and meta["retrieval"]["source"] == "prompt_variable"
        assert not [w for w in caught if str(w.message) == NO_PASSAGES_WARNING]
    for needle in (".bind(passages=", "create_tokrag_chain(", "prompt="):
        assert needle in NO_PASSAGES_WARNING
