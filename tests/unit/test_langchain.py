"""LangChain adapters on the real default model: ChatTokRAG and create_tokrag_chain.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_langchain.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from tokrag_integrations.langchain import ChatTokRAG
from tokrag_integrations.langchain.messages import document_passages, messages_to_prompt
from tokrag_integrations.prompts import Passage


def test_missing_langchain_gives_install_hint() -> None:
    code = (
        "import sys; sys.modules['langchain_core'] = None\n"
        "try:\n import tokrag_integrations.langchain\nexcept ImportError as e:\n print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'tokrag-integrations[langchain]'" in out.stdout


def test_documents_become_passages_in_retriever_order() -> None:
    d1 = Document(page_content="first", metadata={"score": 0.8, "source": "a"})
    d2 = Document(page_content="second", metadata={"source": "b"})
    p1, p2, p3 = document_passages([d1, d2, "plain"])
    assert p1 == Passage(text="first", score=0.8, metadata={"score": 0.8, "source": "a"})
    assert p2 == Passage(text="second", score=None, metadata={"source": "b"})
    assert p3 == "plain"
    with pytest.raises(TypeError, match="must be a list"):
        document_passages(d1)  # type: ignore[arg-type]


def test_messages_translation() -> None:
    p = messages_to_prompt(
        [
            SystemMessage("Be brief."),
            HumanMessage("hello"),
            AIMessage("hi"),
            HumanMessage("part one"),
            HumanMessage("part two"),
        ]
    )
    assert p.system_prompt == "Be brief."
    assert p.history == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
    ]
    assert p.query == "part one\n\npart two"
    assert messages_to_prompt([HumanMessage("q")]).system_prompt is None
    with pytest.raises(ValueError, match="end the list with a HumanMessage"):
        messages_to_prompt([HumanMessage("q"), AIMessage("a")])
    with pytest.raises(ValueError, match="cannot take a ToolMessage here"):
        messages_to_prompt([ToolMessage("x", tool_call_id="1"), HumanMessage("q")])
    image = {"type": "image", "url": "https://example.com/a.png"}
    with pytest.raises(ValueError, match="text only"):
        messages_to_prompt([HumanMessage(content=[{"type": "text", "text": "q"}, image])])


def test_constructor_validation() -> None:
    assert ChatTokRAG(temperature=0.7).temperature == 0.7  # sampling (issue 57)
    with pytest.raises(ValueError, match="top_k"):
        ChatTokRAG(top_k=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        ChatTokRAG(max_tokens=0)
    with pytest.raises(ValueError, match="Extra inputs"):
        ChatTokRAG(max_token=5)
    m = ChatTokRAG(model="default", api_key="unused", timeout=5, max_retries=1)
    assert m._identifying_params["model_name"] == "default"
    assert m._llm_type == "tokrag"
