"""The run's retrieved documents found in a chat model's prompt (issue 45, item 1): the
matching and the run bookkeeping, with no model. The real model in LangChain's own RAG chains:
``tests/integration/test_langchain_retrieved.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda, RunnableParallel

from tokrag_integrations.langchain.retrieved import (
    RUN_DOCUMENTS,
    Filled,
    RunDocuments,
    filled_variables,
    find_retrieved,
    match_documents,
    match_variables,
)

Q = "Who founded Quillfeather?"
A, B, C = "Quillfeather was founded by Ottoline Varga.", "It builds rockets.", "Unrelated text."


def test_span_from_the_first_found_document_to_the_last() -> None:
    system = SystemMessage(f"Context:\n[1] {A}\n\n[2] {B}\nEnd.")
    found = match_documents([system, HumanMessage(Q)], [(Q, [A, B])])
    assert found.context == f"{A}\n\n[2] {B}"  # the text between them is inside the span
    assert found.question == Q
    assert found.metadata == {
        "source": "retriever",
        "documents": 2,
        "found": 2,
        "missing": 0,
        "variable": None,
        "note": None,
    }
    assert [d.page_content for d in found.documents] == [A, B]


def test_found_documents_in_the_prompt_s_order_with_their_ids() -> None:
    # Each found document is a passage of its own: in the order of the span, id and metadata kept.
    docs = [Document(B, id="b", metadata={"source": "b.md"}), Document(C, id="c"), Document(A)]
    found = match_documents([HumanMessage(f"{A}\n\n{B}\n\n{Q}")], [(Q, docs)])
    assert found.documents == [docs[2], docs[0]]


def test_documents_not_in_the_prompt_are_counted_and_said() -> None:
    # One of three rewritten: the others are the span, the missing one is said.
    human = HumanMessage(f"Question: {Q}\nContext: {A}\n\n{B}\n\n{C.upper()}\nAnswer:")
    found = match_documents([human], [(Q, [A, B, C])])
    assert found.context == f"{A}\n\n{B}"
    assert found.question == Q  # the retriever's query, found in the message: the question alone
    assert (found.metadata["found"], found.metadata["missing"]) == (2, 1)
    assert "1 of the 3 documents" in found.metadata["note"]
    # None found, or no retriever: no context, said.
    none = match_documents([HumanMessage(Q)], [(Q, [A, B])])
    assert none.context is None and none.metadata["source"] == "none"
    assert (none.metadata["documents"], none.metadata["missing"]) == (2, 2)
    assert "did the formatting change" in none.metadata["note"]
    empty = match_documents([HumanMessage(Q)], [])
    assert empty.context is None and "no retriever ran" in empty.metadata["note"]
    assert match_documents([HumanMessage(Q)], [(Q, ["", "  "])]).metadata["documents"] == 0


def test_stripped_duplicated_and_two_retrievers() -> None:
    # A document's outer whitespace is not its text; a text two retrievers returned counts once.
    human = HumanMessage(f"{A}\n\n{B}\n\nQuestion: {Q}")
    found = match_documents([human], [(Q, [f"  {A}\n"]), ("other query", [A, B])])
    assert found.context == f"{A}\n\n{B}"
    assert found.metadata["documents"] == 2 and found.metadata["found"] == 2
    # Two different queries: rendered_prompt's default question (the message without the span).
    assert found.question is None


def test_question_when_the_message_holds_only_the_documents() -> None:
    # The query is the pure context's question; with none, there is no pure context: said.
    assert match_documents([HumanMessage(A)], [(Q, [A])]).question == Q
    none = match_documents([HumanMessage(A)], [(None, [A])])
    assert none.context is None and "no question" in none.metadata["note"]
    # The message holding the most documents holds the span (here the second one).
    msgs = [
        SystemMessage(f"Note: {C}"),
        HumanMessage(f"{A} {B} {Q}"),
        AIMessage("ok"),
        HumanMessage(Q),
    ]
    found = match_documents(msgs, [(Q, [A, B, C])])
    assert found.context == f"{A} {B}" and found.metadata["missing"] == 1


class _Fixed(BaseRetriever):
    def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
        return [Document(page_content=f"about {query}")]


def _lookup(_: Any, config: Any) -> list[tuple[str | None, list[str]]]:
    """What a chat model called here would find (its parent: this lambda's run), as texts."""
    found = RUN_DOCUMENTS.documents(config["callbacks"].parent_run_id)
    return [(q, [d.page_content for d in docs]) for q, docs in found]


def test_each_run_sees_its_own_retrievers_and_nothing_is_kept() -> None:
    chain = RunnableParallel(context=_Fixed(), question=lambda q: q) | RunnableLambda(_lookup)
    outs = chain.batch([f"q{i}" for i in range(8)])
    assert outs == [[(f"q{i}", [f"about q{i}"])] for i in range(8)]

    async def many() -> list[Any]:
        return await asyncio.gather(*(chain.ainvoke(f"a{i}") for i in range(8)))

    assert asyncio.run(many()) == [[(f"a{i}", [f"about a{i}"])] for i in range(8)]
    # Inside one run, each mapped item's chat model sees the nearest run's documents only.
    mapped = RunnableLambda(lambda qs: qs) | chain.map()
    assert mapped.invoke(["x", "y"]) == [[("x", ["about x"])], [("y", ["about y"])]]
    assert RUN_DOCUMENTS.open_runs() == 0
    # A chat model called outside any run (no run manager, no runnable config) finds nothing.
    assert find_retrieved([HumanMessage(Q)], None).metadata["documents"] == 0


def test_runs_that_never_end_are_bounded() -> None:
    from uuid import uuid4

    runs = RunDocuments(max_runs=5)
    root = uuid4()
    runs.on_chain_start({}, {}, run_id=root)
    for _ in range(20):
        runs.on_chain_start({}, {}, run_id=uuid4(), parent_run_id=root)
    assert runs.open_runs() == 5
    assert runs.documents(root) == []  # the oldest (the root) was dropped


def test_a_context_is_cut_after_each_document_it_holds() -> None:
    # context= with passages=: one piece per document found (its id kept), the pieces make up
    # the context; a document not in it is said and left out. Issue 55: the core's one rule
    # (tokrag_integrations.adapters.chat.split_context, shared with LlamaIndex): text outside every
    # document ("[1] ", "End.") is a piece of its own, never folded into a document.
    from tokrag_integrations.adapters.chat import TEMPLATE_CONTEXT, split_context
    from tokrag_integrations.langchain.messages import document_passages

    docs = document_passages([Document(A, id="a", metadata={"source": "a.md"}), Document(C), B])
    context = f"[1] {A}\n\n[2] {B}\nEnd."
    with pytest.warns(UserWarning, match=r"passage\(s\) \[1\] are not in the context"):
        parts = split_context(context, docs)
    assert [p.text for p in parts] == ["[1] ", A, "\n\n[2] ", B, "\nEnd."]
    assert [p.metadata for p in parts] == [
        TEMPLATE_CONTEXT, {"source": "a.md", "id": "a"}, TEMPLATE_CONTEXT, {}, TEMPLATE_CONTEXT
    ]
    with pytest.warns(UserWarning, match="not in the context"):
        assert split_context("nothing here", docs[:1]) is None


# ------------------------------------------------------------------ prompt variables (issue 57, item 5)
def test_filled_prompt_variables() -> None:
    doc = Document(A)
    assert filled_variables({"context": A, "question": Q}) == [Filled("context", A, Q)]
    assert filled_variables({"documents": [doc], "input": Q}) == [Filled("documents", str([doc]), Q)]
    # Empty, missing, or of another kind: nothing.
    assert filled_variables({"context": "  ", "question": Q}) == []
    assert filled_variables({"context": 3}) == [] and filled_variables("text") == []


def test_a_filled_variable_found_in_the_prompt_is_the_context() -> None:
    human = HumanMessage(f"Question: {Q}\nContext: {A}\nAnswer:")
    nothing = match_documents([human], [])
    found = match_variables([human], [Filled("context", f"{A}\n", Q)], nothing)
    assert found is not None and found.context == A and found.question == Q
    assert found.metadata["source"] == "prompt_variable"
    assert found.metadata["variable"] == "context" and found.metadata["note"] is None
    assert [d.page_content for d in found.documents] == [A]
    # The run's documents were not in the prompt: said in the note.
    missed = match_documents([human], [(Q, [B])])
    found = match_variables([human], [Filled("context", A, Q)], missed)
    assert found is not None and "none of the 1 documents" in found.metadata["note"]
    # Not in the prompt, or no question left for the pure context: not the context.
    assert match_variables([human], [Filled("context", C, Q)], nothing) is None
    assert match_variables([HumanMessage(A)], [Filled("context", A, None)], nothing) is None


def _variables(_: Any, config: Any) -> list[Filled]:
    """What a chat model called here would find of the prompts formatted before it."""
    return RUN_DOCUMENTS.prompt_variables(config["callbacks"].parent_run_id)


def test_a_prompt_template_run_records_its_variables_on_the_runs_above() -> None:
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([("human", "Q: {question}\nContext: {context}")])

    def node(state: dict[str, str], config: Any) -> list[Filled]:
        prompt.invoke(state, config)
        return _variables(None, config)

    outs = RunnableLambda(node).batch([{"question": f"q{i}", "context": f"c{i}"} for i in range(4)])
    assert outs == [[Filled("context", f"c{i}", f"q{i}")] for i in range(4)]
    assert RUN_DOCUMENTS.open_runs() == 0
