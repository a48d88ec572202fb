"""Tok-RAG on a LangChain user's own prompt (issue 27, LangChain half).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_langchain_templates.py``."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import PromptTemplate

from tokrag_integrations.langchain.messages import rendered_prompt
from tokrag_integrations.langchain.tokrag_chain import format_documents

QUESTION = "Who founded Quillfeather Aerospace?"


def test_document_prompt_and_separator_build_the_context() -> None:
    docs = [
        Document(page_content="one", metadata={"source": "a.md"}),
        Document(page_content="two", metadata={"source": "b.md"}),
    ]
    assert format_documents(docs) == "one\n\ntwo"  # create_stuff_documents_chain's defaults
    dp = PromptTemplate.from_template("[{source}] {page_content}")
    assert format_documents(docs, dp, "\n---\n") == "[a.md] one\n---\n[b.md] two"


# ------------------------------------------------------------------ the pure context's parts
def test_rendered_prompt_splits_the_pure_context() -> None:
    ctx = "Quillfeather was founded by Ottoline Varga."
    msgs = [
        SystemMessage("You are terse."),
        SystemMessage(f"Context:\n{ctx}"),
        HumanMessage("earlier question"),
        AIMessage("earlier answer"),
        HumanMessage(f"Question: {QUESTION}"),
    ]
    rendered, pure = rendered_prompt(msgs, ctx, QUESTION)
    assert rendered.context == ctx and rendered.messages[1]["content"] == f"Context:\n{ctx}"
    assert [m["role"] for m in rendered.messages] == [
        "system", "system", "user", "assistant", "user"
    ]
    assert pure.query == QUESTION and pure.system_prompt == "You are terse."
    assert pure.history == [
        {"role": "user", "content": "earlier question"},
        {"role": "assistant", "content": "earlier answer"},
    ]
    # Without question=: the last human turn, the context taken out of it.
    _, pure = rendered_prompt([HumanMessage(f"{ctx}\n\n{QUESTION}")], ctx)
    assert pure.query == QUESTION and pure.system_prompt is None
    with pytest.raises(ValueError, match="pass question="):
        rendered_prompt([HumanMessage(ctx)], ctx)
