"""One set of defaults (:mod:`tokrag_integrations.defaults`) behind every entry point.

``tokrag ask --docs``, the LlamaIndex quickstart pattern (``FolderRetriever`` ->
``RetrieverQueryEngine`` with ``TokRAGSynthesizer``) and the LangChain quickstart pattern
(``FolderRetriever`` -> ``create_tokrag_chain`` with ``ChatTokRAG``) give the same answer to
the same question over the same documents when nothing is set; and the default stop strings
end an answer at its first blank line, on the real model.

Cases that need no model, database or server are in ``tests/unit/test_defaults.py``."""

from __future__ import annotations

import contextlib
import io

import pytest

import tokrag_integrations
from tokrag_integrations import cli, generate
from tokrag_integrations.defaults import (
    ANSWER_STOP,
    MAX_NEW_TOKENS,
)
from tokrag_integrations.retrieval import get_sample_docs_path

# Runs to the 64-token cap on the default model (a numbered list, one item per line), so
# the answer budget of every entry point shows in the answer.
CAPPED_Q = (
    "After how many minutes is an unacknowledged page escalated to the secondary on-call engineer?"
)
KESTREL_Q = "What is the code name of the Kestrel-7 programme?"


def test_a_chain_without_stop_uses_the_answer_stop_and_stop_empty_turns_it_off(lm) -> None:
    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.langchain.chains import _chat_model, create_tokrag_chain

    def stop_of(model, stop):
        return _chat_model(
            model,
            create_tokrag_chain,
            temperature=None,
            policy=None,
            max_tokens=None,
            stop=stop,
            max_context_tokens=None,
            policy_options={},
        )[1].get("stop")

    assert stop_of(ChatTokRAG(model=lm), None) == list(ANSWER_STOP)
    assert stop_of(ChatTokRAG(model=lm), []) == []
    assert stop_of(ChatTokRAG(model=lm, stop=["END"]), None) is None  # the model's own


def _cli_answer(question: str, lm, monkeypatch: pytest.MonkeyPatch) -> str:
    # The CLI's own load_model("default") would load a second copy of the same model.
    monkeypatch.setattr(tokrag_integrations, "load_model", lambda *a, **k: lm)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["ask", question, "--docs", "sample"])
    assert code == 0, err.getvalue()
    return out.getvalue().removesuffix("\n")


def _llamaindex_answer(question: str, lm, policy: str = "tokrag") -> str:
    from llama_index.core.query_engine import RetrieverQueryEngine

    from tokrag_integrations.llama_index import FolderRetriever, TokRAGSynthesizer

    engine = RetrieverQueryEngine(
        retriever=FolderRetriever(get_sample_docs_path()),
        response_synthesizer=TokRAGSynthesizer(lm, policy=policy),
    )
    return str(engine.query(question))


def _langchain_answer(question: str, lm) -> str:
    from tokrag_integrations.langchain import ChatTokRAG, FolderRetriever, create_tokrag_chain

    chain = create_tokrag_chain(
        FolderRetriever(paths=[str(get_sample_docs_path())]), ChatTokRAG(model=lm)
    )
    return chain.invoke(question)["answer"]


def test_cli_llamaindex_and_langchain_patterns_give_the_same_answer(lm, monkeypatch) -> None:
    """The question runs to the cap: a different budget, chunking, top-k or stop in one
    entry point would show as a different answer."""
    via_cli = _cli_answer(CAPPED_Q, lm, monkeypatch)
    via_llamaindex = _llamaindex_answer(CAPPED_Q, lm)
    via_langchain = _langchain_answer(CAPPED_Q, lm)
    assert via_cli.strip()
    assert via_llamaindex == via_cli
    assert via_langchain == via_cli


def test_quickstart_claim_both_policies_state_the_code_name(lm) -> None:
    """examples/llamaindex_quickstart.py's docstring: on its default question both
    ``tokrag`` and ``rag`` answer with the handbook's code name."""
    for policy in ("tokrag", "rag"):
        assert "Bramblewick" in _llamaindex_answer(KESTREL_Q, lm, policy), policy


def test_answer_stop_ends_the_answer_at_its_first_blank_line(lm) -> None:
    """Without stops the model writes on past a blank line; with the default stops the
    answer is the same text up to it, and the trace says a stop string ended it."""
    question = "Write a short Markdown document with a title and two sections."
    free = generate(lm, question, None, policy="no_rag", max_new_tokens=MAX_NEW_TOKENS, stop=[])
    assert "\n\n" in free.text.strip(), free.text  # the premise: it runs past a paragraph
    stopped = generate(
        lm, question, None, policy="no_rag", max_new_tokens=MAX_NEW_TOKENS, stop=ANSWER_STOP
    )
    assert stopped.text == free.text[: free.text.index("\n\n")]
    assert stopped.stop_reason == "stop"
    assert len(stopped.token_ids) < len(free.token_ids)
