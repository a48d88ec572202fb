"""Tests for local retrieval: loading, chunking, and the real MiniLM and BM25 retrievers.

This file holds the cases that need the real model, a database, a server or a subprocess; the others are in
``tests/unit/test_retrieval.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokrag_integrations.retrieval import (
    BM25Retriever,
    Chunk,
    DenseRetriever,
    ScoredChunk,
    build_retriever,
    chunk_documents,
    get_sample_docs_path,
    get_sample_questions,
    load_documents,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = get_sample_questions()


# ------------------------------------------------------------------------ retrievers
@pytest.fixture(scope="module")
def sample_chunks() -> list[Chunk]:
    return chunk_documents(load_documents(get_sample_docs_path()))


@pytest.fixture(scope="module")
def dense(sample_chunks: list[Chunk]) -> DenseRetriever:
    return DenseRetriever(sample_chunks)


@pytest.fixture(scope="module")
def bm25(sample_chunks: list[Chunk]) -> BM25Retriever:
    return BM25Retriever(sample_chunks)


@pytest.mark.parametrize("kind", ["dense", "bm25"])
@pytest.mark.parametrize("item", QUESTIONS, ids=[q["answer"] for q in QUESTIONS])
def test_retrievers_find_the_answer(
    kind: str, item: dict, dense: DenseRetriever, bm25: BM25Retriever
) -> None:
    retriever = dense if kind == "dense" else bm25
    results = retriever.retrieve(item["question"], top_k=5)
    assert results and all(isinstance(r, ScoredChunk) for r in results)
    scores = [r.score for r in results]
    assert scores == sorted(scores, reverse=True)
    assert any(item["answer"] in r.text for r in results), [r.source for r in results]
    assert Path(results[0].source).name == item["source"] or kind == "dense"


def test_dense_top1_on_clear_question(dense: DenseRetriever) -> None:
    (best,) = dense.retrieve("What is the guest Wi-Fi network at the Dundee office called?", 1)
    assert best.source.endswith("visitor_guide.html")
    assert 0.3 < best.score <= 1.0  # cosine of normalised embeddings


@pytest.mark.parametrize("kind", ["dense", "bm25"])
def test_retrieve_argument_errors(kind: str, dense: DenseRetriever, bm25: BM25Retriever) -> None:
    retriever = dense if kind == "dense" else bm25
    with pytest.raises(ValueError, match="query is empty"):
        retriever.retrieve("   ")
    with pytest.raises(ValueError, match="top_k"):
        retriever.retrieve("leave", top_k=0)
    assert len(retriever.retrieve("leave policy", top_k=1000)) <= len(retriever.chunks)


def test_build_retriever_from_paths_documents_and_chunks(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Cats\n\nCats purr when content.", encoding="utf-8")
    (tmp_path / "b.txt").write_text("Dogs bark at the postman.", encoding="utf-8")
    r = build_retriever(tmp_path, kind="bm25")
    assert r.retrieve("why do cats purr")[0].source.endswith("a.md")
    docs = load_documents([tmp_path / "a.md", tmp_path / "b.txt"])
    assert isinstance(build_retriever(docs, kind="bm25"), BM25Retriever)
    d = build_retriever(chunk_documents(docs), kind="dense")
    assert d.retrieve("barking dog")[0].source.endswith("b.txt")


def test_embedding_cache_embeds_only_what_changed(tmp_path, monkeypatch):
    """A folder indexed again embeds nothing; a changed file's chunks alone are embedded;
    the cached vectors give the same ranking as fresh ones."""
    from tokrag_integrations.retrieval import build_retriever

    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Quillfeather Aerospace was founded by Ottoline Varga in 2009.", encoding="utf-8")
    (docs / "b.md").write_text("The canteen serves porridge every Tuesday morning.", encoding="utf-8")
    first = build_retriever(docs, cache=True)
    assert first.n_embedded == 2
    again = build_retriever(docs, cache=True)
    assert again.n_embedded == 0
    q = "Who founded Quillfeather?"
    assert [(h.text, round(h.score, 6)) for h in again.retrieve(q, 2)] == [
        (h.text, round(h.score, 6)) for h in first.retrieve(q, 2)
    ]
    (docs / "b.md").write_text("The canteen serves porridge every Friday morning.", encoding="utf-8")
    changed = build_retriever(docs, cache=True)
    assert changed.n_embedded == 1
    assert build_retriever(docs).n_embedded == 2  # cache=False (the library default) embeds all
