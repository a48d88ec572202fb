"""One set of defaults (:mod:`tokrag_integrations.defaults`) behind every entry point.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_defaults.py``."""

from __future__ import annotations

import contextlib
import inspect
import io

import pytest

from tokrag_integrations import cli
from tokrag_integrations.cli.console import stop_strings
from tokrag_integrations.defaults import (
    ANSWER_STOP,
    CHUNK_CHARS,
    CHUNK_OVERLAP,
    MAX_NEW_TOKENS,
    RETRIEVER,
    TOP_K,
)
from tokrag_integrations.retrieval import build_retriever, chunk_text


def _defaults(func) -> dict:
    return {
        k: p.default
        for k, p in inspect.signature(func).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_every_entry_point_reads_the_same_defaults() -> None:
    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.langchain import FolderRetriever as LCRetriever
    from tokrag_integrations.llama_index import FolderRetriever as LIRetriever
    from tokrag_integrations.llama_index import TokRAGLLM, TokRAGSynthesizer

    args = cli.build_parser().parse_args(["ask", "q"])
    assert (args.top_k, args.max_new_tokens, args.retriever) == (TOP_K, MAX_NEW_TOKENS, RETRIEVER)
    assert stop_strings(args) == list(ANSWER_STOP)
    assert _defaults(chunk_text) == {"max_chars": CHUNK_CHARS, "overlap": CHUNK_OVERLAP}
    assert {k: _defaults(build_retriever)[k] for k in ("max_chars", "overlap", "kind")} == {
        "max_chars": CHUNK_CHARS,
        "overlap": CHUNK_OVERLAP,
        "kind": RETRIEVER,
    }
    synth = _defaults(TokRAGSynthesizer.__init__)
    assert (synth["max_new_tokens"], synth["stop"]) == (MAX_NEW_TOKENS, ANSWER_STOP)
    assert TokRAGLLM.model_fields["max_new_tokens"].default == MAX_NEW_TOKENS
    assert ChatTokRAG.model_fields["max_tokens"].default == MAX_NEW_TOKENS
    li = _defaults(LIRetriever.__init__)
    assert (li["top_k"], li["max_chars"], li["overlap"], li["retriever"]) == (
        TOP_K,
        CHUNK_CHARS,
        CHUNK_OVERLAP,
        RETRIEVER,
    )
    lc = {k: f.default for k, f in LCRetriever.model_fields.items()}
    assert (lc["top_k"], lc["max_chars"], lc["overlap"], lc["retriever"]) == (
        TOP_K,
        CHUNK_CHARS,
        CHUNK_OVERLAP,
        RETRIEVER,
    )


def test_cli_stop_options() -> None:
    parse = cli.build_parser().parse_args
    assert stop_strings(parse(["ask", "q", "--no-stop"])) == []
    assert stop_strings(parse(["ask", "q", "--stop", "\\n", "--stop", "END"])) == ["\n", "END"]
    with pytest.raises(ValueError, match="--stop needs a non-empty text"):
        stop_strings(parse(["ask", "q", "--stop", ""]))
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        parse(["ask", "q", "--stop", "x", "--no-stop"])  # one or the other
