"""LangChain's own RAG code decodes with Tok-RAG unchanged (issue 45, item 1).

The LCEL recipe (``{"context": retriever | format_docs, "question": RunnablePassthrough()} |
prompt | ChatTokRAG() | StrOutputParser()``), ``create_retrieval_chain`` +
``create_stuff_documents_chain``, and a ``RunnableWithMessageHistory`` around the latter, each
invoked, awaited, streamed and batched: ChatTokRAG finds the documents the run's retriever
returned in its prompt, and decodes exactly as the explicit ``context=`` call on the same
messages. Documents the formatting rewrote: the plain model, and ``response_metadata`` says
why on every call. Real default model, answers of 3 tokens, one retriever returning fixed
documents per question.

The matching and the run bookkeeping without a model: ``tests/unit/test_langchain_retrieved.py``.
"""

from __future__ import annotations

import asyncio
import warnings
from typing import Any
from uuid import UUID

import pytest
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough
from langchain_core.runnables.history import RunnableWithMessageHistory

from tokrag_integrations.langchain import ChatTokRAG
from tokrag_integrations.langchain.calls import NO_PASSAGES_WARNING
from tokrag_integrations.langchain.retrieved import RUN_DOCUMENTS
from tokrag_integrations.trace import comparable

Q1, Q2 = "Who founded Quillfeather Aerospace?", "Who designed the Brindlewick Observatory?"
DOCS = {
    Q1: [
        "Quillfeather Aerospace was founded by Ottoline Varga in 1987.",
        "Its first rocket flew in 1993.",
    ],
    Q2: ["The Brindlewick Observatory was designed by Tamsin Oakes.", "It opened in 1921."],
}
#: LangChain's RAG tutorial prompt (the documents and the question in one human message).
RAG_PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "human",
            "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
            "context to answer the question. If you don't know the answer, just say that you don't "
            "know.\nQuestion: {question}\nContext: {context}\nAnswer:",
        )
    ]
)
#: create_retrieval_chain's documented prompt (the documents in the system message).
SYSTEM = "Use the given context to answer the question.\n\nContext: {context}"
QA_PROMPT = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{input}")])
HISTORY_PROMPT = ChatPromptTemplate.from_messages(
    [("system", SYSTEM), MessagesPlaceholder("chat_history"), ("human", "{input}")]
)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


class Fixed(BaseRetriever):
    """A real retriever (its runs go through LangChain's callbacks) with fixed answers."""

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
        return [Document(page_content=t, metadata={"q": query}) for t in DOCS[query]]


class Calls(BaseCallbackHandler):
    """Every chat model call of a run: the messages it got and the message it answered."""

    def __init__(self) -> None:
        self.messages: dict[UUID, list[BaseMessage]] = {}
        self.answers: dict[UUID, Any] = {}

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: UUID, **_: Any
    ) -> None:
        self.messages[run_id] = messages[0]

    def on_llm_end(self, response: Any, *, run_id: UUID, **_: Any) -> None:
        self.answers[run_id] = response.generations[0][0].message

    def pairs(self) -> list[tuple[list[BaseMessage], Any]]:
        assert set(self.messages) == set(self.answers)
        return [(self.messages[r], self.answers[r]) for r in self.messages]


def _stable(meta: dict[str, Any], batched: bool) -> dict[str, Any]:
    """What must equal the explicit call's: the tokens, their sources and the trace, less its
    timings and speed (they differ from run to run: :func:`~tokrag_integrations.trace.comparable`); in a batch also less the steps' probabilities and
    signal values and the citations' scores (a batched forward pass differs from a solo one in
    the last float bits; the choices do not)."""
    trace = comparable(meta["trace"])
    if batched:
        trace["steps"] = [
            (
                s["token_id"],
                s["source"],
                {k: c["token_id"] for k, c in s["candidates"].items()},
                s["signals"].get("note"),
            )
            for s in trace["steps"]
        ]
        trace["citations"] = [(c["start"], c["end"], c["passage"]) for c in trace["citations"]]
    return {
        "token_ids": meta["token_ids"],
        "token_sources": meta["token_sources"],
        "policy": meta["policy"],
        "counts": meta["counts"],
        "trace": trace,
    }


@pytest.fixture(scope="module")
def chat(lm: Any) -> ChatTokRAG:
    return ChatTokRAG(model=lm, max_tokens=3)


@pytest.fixture(scope="module")
def explicit(chat: ChatTokRAG) -> Any:
    """The explicit ``context=`` call on the same messages (each distinct one decoded once)."""
    seen: dict[Any, Any] = {}

    def answer(messages: list[BaseMessage], question: str) -> Any:
        key = (tuple((m.type, m.content) for m in messages), question)
        if key not in seen:
            docs = Fixed().invoke(question)
            seen[key] = chat.invoke(
                messages, context=format_docs(docs), question=question, passages=docs
            )
        return seen[key]

    return answer


def _check(calls: Calls, questions: list[str], explicit: Any, batched: bool = False) -> list[str]:
    """Each call decoded with Tok-RAG over exactly its own question's documents, as the explicit
    ``context=`` call; returns the answers in the order of ``questions``."""
    pairs = calls.pairs()
    assert len(pairs) == len(questions)
    by_question = {}
    for messages, msg in pairs:
        meta = msg.response_metadata
        question = meta["trace"]["query"]  # the pure context is the question alone
        by_question[question] = msg.content
        assert meta["policy"] == "tokrag"
        assert meta["retrieval"] == {
            "source": "retriever",
            "documents": 2,
            "found": 2,
            "missing": 0,
            "variable": None,
            "note": None,
        }
        counts = meta["counts"]
        assert sum(counts.values()) == len(meta["token_ids"]) == 3
        assert counts.get("agree", 0) + counts.get("rag", 0) > 0 and set(counts) <= {
            "agree",
            "rag",
            "pure",
        }
        # The retrieved span: the documents, exactly, each a passage with its metadata (the
        # span cut after each document's text).
        passages = meta["trace"]["passages"]
        docs = Fixed().invoke(question)
        assert "".join(p["text"] for p in passages) == format_docs(docs)
        assert [(p["text"].strip(), p["metadata"], p["kept"], p["cut"]) for p in passages] == [
            (d.page_content, d.metadata, True, False) for d in docs
        ]
        want = explicit(messages, question)
        assert msg.content == want.content
        assert _stable(meta, batched) == _stable(want.response_metadata, batched)
    assert sorted(by_question) == sorted(questions)
    return [by_question[q] for q in questions]


def _run_modes(
    chain: Any,
    inputs: dict[str, Any],
    answer_of: Any,
    explicit: Any,
    configs: dict[str, dict[str, Any]] | None = None,
) -> None:
    """invoke, ainvoke, stream (each on Q1 then Q2 / Q2 / Q1) and batch (Q1 and Q2)."""
    configs = configs or {}

    def config(mode: str, calls: Calls) -> dict[str, Any]:
        return {**configs.get(mode, {}), "callbacks": [calls]}

    calls = Calls()
    out = chain.invoke(inputs[Q1], config=config("invoke", calls))
    assert _check(calls, [Q1], explicit) == [answer_of(out)]

    calls = Calls()
    out = asyncio.run(chain.ainvoke(inputs[Q2], config=config("ainvoke", calls)))
    assert _check(calls, [Q2], explicit) == [answer_of(out)]

    calls = Calls()
    chunks = list(chain.stream(inputs[Q1], config=config("stream", calls)))
    assert _check(calls, [Q1], explicit) == ["".join(answer_of(c) for c in chunks)]

    calls = Calls()
    batch = [config("batch1", calls), config("batch2", calls)]
    outs = chain.batch([inputs[Q1], inputs[Q2]], config=batch)
    assert _check(calls, [Q1, Q2], explicit, batched=True) == [answer_of(o) for o in outs]
    assert RUN_DOCUMENTS.open_runs() == 0  # every run ended: nothing kept


def test_lcel_recipe(chat: ChatTokRAG, explicit: Any) -> None:
    chain = (
        {"context": Fixed() | format_docs, "question": RunnablePassthrough()}
        | RAG_PROMPT
        | chat
        | StrOutputParser()
    )
    _run_modes(chain, {Q1: Q1, Q2: Q2}, lambda out: out, explicit)

    async def astream(calls: Calls) -> str:  # BaseChatModel.astream: no run manager given
        return "".join([c async for c in chain.astream(Q2, config={"callbacks": [calls]})])

    calls = Calls()
    answer = asyncio.run(astream(calls))
    assert _check(calls, [Q2], explicit) == [answer]


def _answer(out: dict[str, Any]) -> str:
    return out.get("answer", "")


def test_create_retrieval_chain(chat: ChatTokRAG, explicit: Any) -> None:
    chain = create_retrieval_chain(Fixed(), create_stuff_documents_chain(chat, QA_PROMPT))
    _run_modes(chain, {Q1: {"input": Q1}, Q2: {"input": Q2}}, _answer, explicit)


def test_with_message_history(chat: ChatTokRAG, explicit: Any) -> None:
    """The conversation fills the prompt; invoke, ainvoke and stream share one session (each
    call sees the earlier turns), the batch's two inputs have a session each."""
    sessions: dict[str, InMemoryChatMessageHistory] = {}
    chain = RunnableWithMessageHistory(
        create_retrieval_chain(Fixed(), create_stuff_documents_chain(chat, HISTORY_PROMPT)),
        lambda sid: sessions.setdefault(sid, InMemoryChatMessageHistory()),
        input_messages_key="input",
        history_messages_key="chat_history",
        output_messages_key="answer",
    )
    session = {"configurable": {"session_id": "s"}}
    configs = {
        "invoke": session,
        "ainvoke": session,
        "stream": session,
        "batch1": {"configurable": {"session_id": "a"}},
        "batch2": {"configurable": {"session_id": "b"}},
    }
    _run_modes(chain, {Q1: {"input": Q1}, Q2: {"input": Q2}}, _answer, explicit, configs)
    assert len(sessions["s"].messages) == 6  # three turns, each question and its answer
    assert [m.content for m in sessions["s"].messages[::2]] == [Q1, Q2, Q1]


def test_rewritten_documents_are_the_prompt_variable_said_on_every_call(lm: Any) -> None:
    """format_docs changed the text: none of the run's documents is found as returned, but the
    prompt's ``context`` variable received the rewritten text: that is the retrieved text,
    and every call's metadata says which rule found it and why the documents were not."""
    chat = ChatTokRAG(model=lm, max_tokens=2)

    def shout(docs: list[Document]) -> str:
        return "\n".join(f"- {d.page_content.upper()}" for d in docs)

    prompt_chat = (
        {"context": Fixed() | shout, "question": RunnablePassthrough()} | RAG_PROMPT | chat
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        messages = [prompt_chat.invoke(Q1), prompt_chat.invoke(Q2)]
        chunks = list(prompt_chat.stream(Q1))
    messages.append(sum(chunks[1:], chunks[0]))
    for msg, q in zip(messages, [Q1, Q2, Q1], strict=True):
        meta = msg.response_metadata
        assert meta["policy"] == "tokrag" and meta["trace"]["query"] == q
        retrieval = meta["retrieval"]
        assert {k: retrieval[k] for k in ("source", "variable", "documents", "found")} == {
            "source": "prompt_variable",
            "variable": "context",
            "documents": 2,
            "found": 0,
        }
        assert "none of the 2 documents" in retrieval["note"] and "'context'" in retrieval["note"]
        assert "".join(p["text"] for p in meta["trace"]["passages"]) == shout(Fixed().invoke(q))
    assert not [w for w in caught if str(w.message) == NO_PASSAGES_WARNING]

    # No retriever at all: the filled variable is the retrieved text, said as such.
    msg = (RAG_PROMPT | chat).invoke({"question": Q1, "context": DOCS[Q1][0]})
    meta = msg.response_metadata
    assert meta["policy"] == "tokrag" and meta["retrieval"]["source"] == "prompt_variable"
    assert meta["retrieval"]["documents"] == 0 and meta["retrieval"]["note"] is None


def test_langgraph_rag_tutorial_decodes_with_tokrag(lm: Any) -> None:
    """LangGraph's RAG tutorial: a retrieve node calls ``vector_store.similarity_search`` (no
    retriever runnable runs), a generate node fills the RAG prompt's ``context`` and calls the
    chat model. The filled text is the retrieved text: the answer is the explicit
    ``context=`` call's, invoked, streamed and async."""
    from langchain_core.vectorstores import InMemoryVectorStore
    from langgraph.graph import START, StateGraph
    from typing_extensions import TypedDict

    from tokrag_integrations.langchain import local_embeddings

    class State(TypedDict):
        question: str
        context: list[Document]
        answer: Any

    store = InMemoryVectorStore(local_embeddings())
    store.add_texts([t for texts in DOCS.values() for t in texts])
    chat = ChatTokRAG(model=lm, max_tokens=3)

    def retrieve(state: State) -> dict[str, Any]:
        return {"context": store.similarity_search(state["question"], k=2)}

    def generate(state: State) -> dict[str, Any]:
        docs_content = "\n\n".join(doc.page_content for doc in state["context"])
        messages = RAG_PROMPT.invoke({"question": state["question"], "context": docs_content})
        return {"answer": chat.invoke(messages)}

    builder = StateGraph(State).add_sequence([retrieve, generate])
    builder.add_edge(START, "retrieve")
    graph = builder.compile()

    out = graph.invoke({"question": Q1})
    msg, docs = out["answer"], out["context"]
    assert sorted(d.page_content for d in docs) == sorted(DOCS[Q1])
    meta = msg.response_metadata
    assert meta["policy"] == "tokrag" and meta["trace"]["query"] == Q1
    assert {k: meta["retrieval"][k] for k in ("source", "variable", "note")} == {
        "source": "prompt_variable",
        "variable": "context",
        "note": None,
    }
    counts = meta["counts"]
    assert counts.get("agree", 0) + counts.get("rag", 0) > 0
    context = "\n\n".join(d.page_content for d in docs)
    messages = RAG_PROMPT.invoke({"question": Q1, "context": context}).to_messages()
    as_passage = Document(context, metadata={"source": "prompt variable 'context'"})
    want = chat.invoke(messages, context=context, question=Q1, passages=[as_passage])
    assert msg.content == want.content
    assert _stable(meta, False) == _stable(want.response_metadata, False)
    # The same answer streamed through the graph (LangGraph streams the model's tokens) and
    # with ainvoke.
    tokens = [
        m.content
        for m, _ in graph.stream({"question": Q1}, stream_mode="messages")
        if m.content
    ]
    assert "".join(tokens) == want.content
    got = asyncio.run(graph.ainvoke({"question": Q1}))["answer"]
    assert got.content == want.content and got.response_metadata["retrieval"]["source"] == "prompt_variable"
    assert RUN_DOCUMENTS.open_runs() == 0


def test_explicit_passages_win(chat: ChatTokRAG) -> None:
    """``.bind(passages=)`` in the same recipe: the package's own prompt over those passages,
    not the captured documents."""
    other = [Document(page_content="Quillfeather's founder is Ottoline Varga.")]
    chain = (
        {"context": Fixed() | format_docs, "question": RunnablePassthrough()}
        | RAG_PROMPT
        | chat.bind(passages=other)
    )
    meta = chain.invoke(Q1).response_metadata
    assert meta["retrieval"]["source"] == "passages" and meta["policy"] == "tokrag"
    assert [p["text"] for p in meta["trace"]["passages"]] == [other[0].page_content]
