"""Citations through LangChain (issue 46) on the packaged model, on the core acceptance case
(``test_citations.py``: two documents on topic, the founder's name only in the second): the
name is cited to the document holding it, by its ``id``, whichever place it has, through
``ChatTokRAG`` with ``context=``, LangChain's LCEL recipe (invoked and streamed) and the
TokRAG chain (whose ``context`` comes back by contribution); ``citations=False`` gives none.

The pieces without a model: ``tests/unit/test_langchain_retrieved.py``."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnablePassthrough

from tokrag_integrations.langchain import ChatTokRAG, create_tokrag_chain

from .test_citations import FACT, ON_TOPIC, QUESTION, WITH_FACT

FACTORY = Document(ON_TOPIC.text, id="factory", metadata=dict(ON_TOPIC.metadata))
HISTORY = Document(WITH_FACT.text, id="history", metadata=dict(WITH_FACT.metadata))
ORDERS = ([FACTORY, HISTORY], [HISTORY, FACTORY])
PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
)


class Fixed(BaseRetriever):
    """A real retriever (its run goes through LangChain's callbacks) with fixed documents."""

    docs: list[Document]

    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
        return list(self.docs)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def fact_cited_to(citations: list[dict[str, Any]]) -> tuple[str, int]:
    """(id, passage index) of the span holding most of the fact's characters."""
    text = "".join(c["text"] for c in citations)
    at = text.find(FACT)
    assert at >= 0, f"the answer lacks the fact: {text!r}"
    pos, overlap = 0, []
    for c in citations:
        overlap.append(min(pos + len(c["text"]), at + len(FACT)) - max(pos, at))
        pos += len(c["text"])
    best = citations[max(range(len(citations)), key=overlap.__getitem__)]
    return best["metadata"].get("id"), best["passage"]


@pytest.fixture(scope="module")
def chat(lm: Any) -> ChatTokRAG:
    return ChatTokRAG(model=lm, max_tokens=16)


@pytest.fixture(scope="module")
def explicit(chat: ChatTokRAG) -> list[Any]:
    """ChatTokRAG with ``context=`` and the documents it holds (``passages=``), both orders."""
    out = []
    for docs in ORDERS:
        messages = PROMPT.invoke({"context": format_docs(docs), "question": QUESTION})
        out.append(
            chat.invoke(messages, context=format_docs(docs), question=QUESTION, passages=docs)
        )
    return out


def test_chat_with_context_cites_the_fact_to_its_document_in_either_order(explicit):
    for docs, msg in zip(ORDERS, explicit, strict=True):
        citations = msg.response_metadata["citations"]
        assert citations == msg.response_metadata["trace"]["citations"]
        assert "".join(c["text"] for c in citations) == msg.content
        assert fact_cited_to(citations) == ("history", docs.index(HISTORY))
        cited = {c["metadata"]["id"]: c for c in citations if c["passage"] is not None}
        assert cited["history"]["source"] == "history.md"
        assert cited["history"]["metadata"] == {"source": "history.md", "id": "history"}


def test_lcel_recipe_cites_like_the_explicit_call_invoked_and_streamed(chat, explicit):
    """LangChain's recipe: the run's documents, found in the prompt, are the passages."""

    def recipe(docs: list[Document]) -> Any:
        retrieve = Fixed(docs=docs) | format_docs
        return {"context": retrieve, "question": RunnablePassthrough()} | PROMPT | chat

    msg = recipe(ORDERS[0]).invoke(QUESTION)
    assert msg.response_metadata["retrieval"]["found"] == 2
    assert msg.content == explicit[0].content
    assert msg.response_metadata["citations"] == explicit[0].response_metadata["citations"]
    # The swapped order, streamed: the citations arrive on the last chunk.
    chunks = list(recipe(ORDERS[1]).stream(QUESTION))
    assert [bool(c.response_metadata.get("citations")) for c in chunks[-2:]] == [False, True]
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert full.content == explicit[1].content
    assert full.response_metadata["citations"] == explicit[1].response_metadata["citations"]


def test_tokrag_chain_cites_and_orders_its_documents_by_contribution(chat, explicit):
    for docs in ORDERS:
        out = create_tokrag_chain(Fixed(docs=docs), chat, max_tokens=20).invoke(QUESTION)
        assert fact_cited_to(out["citations"]) == ("history", docs.index(HISTORY))
        assert [d.id for d in out["context"]] == ["history", "factory"]
        shares = dict(_contributions(out["trace"]))
        assert shares[docs.index(HISTORY)] > shares[docs.index(FACTORY)]
    # With the user's prompt: the same decode as ChatTokRAG's context= call.
    out = create_tokrag_chain(Fixed(docs=ORDERS[1]), chat, PROMPT).invoke({"question": QUESTION})
    assert out["answer"] == explicit[1].content
    assert out["citations"] == explicit[1].response_metadata["citations"]
    # citations=False: none, and the documents in retrieval order.
    off = create_tokrag_chain(Fixed(docs=ORDERS[0]), chat, citations=False, max_tokens=3)
    out = off.invoke(QUESTION)
    assert out["citations"] == [] and [d.id for d in out["context"]] == ["factory", "history"]
    assert all(not s["citation"] for s in out["trace"]["steps"])
    with pytest.raises(TypeError, match="citations"):
        create_tokrag_chain(Fixed(docs=ORDERS[0]), chat, citations="no")


def _contributions(trace: dict[str, Any]) -> list[tuple[int, float]]:
    from tokrag_integrations.trace import Trace

    return Trace.from_dict(trace).contributions()
