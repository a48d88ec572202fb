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
    hybrid = build_retriever(docs, kind="hybrid", cache=True)  # its dense side reads the cache
    assert hybrid.n_embedded == 0
    assert hybrid.retrieve(q, 1)[0].text.startswith("Quillfeather")
    assert build_retriever(docs).n_embedded == 2  # cache=False (the library default) embeds all


# ------------------------------------------------------------------------ hybrid
# A price list among prose about parts: MiniLM cannot tell which catalogue chunk holds a code
# (the rows look alike), BM25 matches the code; hybrid fuses the two rankings.
PARTS = ["flange gasket, nitrile", "shaft seal", "impeller, bronze", "bearing 6204", "valve seat",
         "o-ring kit", "coupling insert", "pressure switch", "drain plug", "motor fan cover"]  # fmt: skip
CODES = [f"RX-{2200 + i * 7}-{'ABC'[i % 3]}" for i in range(100)]


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import random

    folder = tmp_path_factory.mktemp("catalogue")
    (folder / "ordering.md").write_text(
        "# Ordering spare parts\n\nSpare parts are ordered through the purchasing portal. A "
        "part costs what the current supplier contract says; prices are reviewed every "
        "January. Orders above 500 euros need a second approval from the site manager.\n"
    )
    (folder / "pricing.md").write_text(
        "# How part prices are set\n\nThe price of a spare part covers the supplier's cost, "
        "freight and a 6 % handling charge. Ask purchasing what a part costs before you order "
        "it for a customer repair.\n"
    )
    (folder / "returns.md").write_text(
        "# Returning parts\n\nUnused parts can be returned within 30 days in their original "
        "packaging. The refund is the price paid minus a 10 % restocking fee.\n"
    )
    rng = random.Random(7)
    rows = [f"| {c} | {PARTS[i % 10]} | {rng.randint(4, 180)} EUR |" for i, c in enumerate(CODES)]
    (folder / "catalogue.md").write_text(
        "# Parts catalogue 2026\n\n| code | part | price |\n| --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n"
    )
    return folder


def test_hybrid_folder_retrievers_find_exact_codes_dense_ranks_low(
    catalogue: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both frameworks' ``FolderRetriever(retriever="hybrid")`` put the chunk holding a part
    code in the top 3 for every code asked; dense alone misses most of them."""
    from tokrag_integrations.langchain import FolderRetriever as LCRetriever
    from tokrag_integrations.llama_index import FolderRetriever as LIRetriever

    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    codes = CODES[::10]
    found: dict[str, list[bool]] = {}
    for name in ("dense", "hybrid"):
        li = LIRetriever(catalogue, retriever=name, top_k=3)
        lc = LCRetriever(paths=[str(catalogue)], retriever=name, top_k=3)
        found[name] = []
        for code in codes:
            question = f"How much does part {code} cost?"
            li_texts = [n.node.get_content() for n in li.retrieve(question)]
            lc_texts = [d.page_content for d in lc.invoke(question)]
            assert li_texts == lc_texts  # one retrieval behind both frameworks
            found[name].append(any(code in t for t in li_texts))
    assert all(found["hybrid"]), found
    assert sum(found["dense"]) <= len(codes) // 2, found


def test_ask_docs_retriever_hybrid_finds_the_code(
    catalogue: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_engine: dict
) -> None:
    """``tokrag ask --docs DIR --retriever hybrid`` gives the model the chunk holding the code
    that ``--retriever dense`` leaves out; the second run embeds nothing."""
    from _cli_fakes import run_cli

    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    question = "How much does part RX-2410-A cost?"
    given = {}
    for name in ("dense", "hybrid"):
        argv = ["ask", question, "--docs", str(catalogue), "--retriever", name, "--top-k", "3"]
        code, _, err = run_cli(argv)
        assert code == 0, err
        given[name] = [p.text for p in fake_engine["stream"]["passages"]]
        assert len(given[name]) == 3
    assert "Embedding 0 chunk(s)" in err  # the hybrid run read the dense run's embeddings
    assert any("RX-2410-A" in t for t in given["hybrid"])
    assert not any("RX-2410-A" in t for t in given["dense"])
