"""Tests for local retrieval: loading, chunking, and the real MiniLM and BM25 retrievers.

This file holds the cases that need a model, a database or a server are in
``tests/integration/test_retrieval.py``."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tokrag_integrations.retrieval import (
    BM25Retriever,
    Chunk,
    Document,
    build_retriever,
    chunk_documents,
    chunk_text,
    get_sample_docs_path,
    get_sample_questions,
    load_documents,
)
from tokrag_integrations.retrieval.documents import html_to_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = get_sample_questions()


# ------------------------------------------------------------------------ sample data
def test_sample_docs_are_clean_utf8_and_small() -> None:
    folder = get_sample_docs_path()
    files = sorted(p for p in folder.iterdir() if p.is_file())
    assert 6 <= len(files) <= 10
    assert any(p.suffix == ".html" for p in files)
    for p in files:
        p.read_bytes().decode("utf-8")  # raises if not clean UTF-8
        assert 1000 <= p.stat().st_size <= 4096, p.name


def test_sample_questions_point_at_their_answers() -> None:
    assert len(QUESTIONS) == 10
    docs = {Path(d.source).name: d.text for d in load_documents(get_sample_docs_path())}
    for q in QUESTIONS:
        assert q["answer"] in docs[q["source"]], q


def test_load_sample_docs_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        docs = load_documents(get_sample_docs_path())
    assert len(docs) == len(list(get_sample_docs_path().iterdir()))
    overview = next(d for d in docs if d.source.endswith("company_overview.md"))
    assert overview.metadata["title"] == "Quillfeather Aerospace — Company Overview"
    assert overview.metadata["format"] == "md"


# ------------------------------------------------------------------------ loading
def test_html_is_reduced_to_visible_text(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    page.write_text(
        "<html><head><title>My &amp; Page</title><style>p {color: red}</style>"
        "<script>var secret = 1;</script></head><body><h1>Heading</h1>"
        "<p>First &lt;para&gt; with <b>bold</b>   text.</p><ul><li>one</li><li>two</li></ul>"
        "<!-- a comment --></body></html>",
        encoding="utf-8",
    )
    (doc,) = load_documents(page)
    assert doc.metadata["title"] == "My & Page"
    assert "secret" not in doc.text and "color" not in doc.text and "comment" not in doc.text
    assert "<" not in doc.text.replace("<para>", "")
    assert "First <para> with bold text." in doc.text
    assert doc.text.splitlines()[0] == "Heading"
    assert "one\ntwo" in doc.text


def test_html_to_text_direct() -> None:
    text, title = html_to_text("<div>a</div><div>b<br>c</div>")
    assert title == ""
    assert text.split() == ["a", "b", "c"]


def test_non_utf8_file_warns_and_is_kept(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("Café prices: 5 €".encode("cp1252") + b"\n")
    with pytest.warns(UnicodeWarning, match="latin1.txt.*not valid UTF-8"):
        (doc,) = load_documents(tmp_path)
    assert doc.text.startswith("Caf\ufffd prices")
    assert doc.metadata["decode_errors"] is True


def test_utf8_bom_is_stripped(tmp_path: Path) -> None:
    f = tmp_path / "bom.md"
    f.write_bytes(b"\xef\xbb\xbf# Title\n\nBody.")
    (doc,) = load_documents(f)
    assert doc.text.startswith("# Title")
    assert doc.metadata["title"] == "Title"


def test_folder_loading_filters_and_recurses(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("alpha", encoding="utf-8")
    (tmp_path / "sub" / "b.md").write_text("beta", encoding="utf-8")
    (tmp_path / "sub" / "deeper" / "c.rst").write_text("gamma", encoding="utf-8")
    (tmp_path / "sub" / "d.htm").write_text("<p>delta</p>", encoding="utf-8")
    (tmp_path / "data.json").write_text('{"x": 1}', encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "e.txt").write_text("secret", encoding="utf-8")
    with pytest.warns(UserWarning, match=r"2 file\(s\) of other types skipped \(\.json, \.png\)"):
        docs = load_documents([tmp_path])
    assert sorted(d.text for d in docs) == ["alpha", "beta", "delta", "gamma"]


def test_pdf_is_read_by_the_shared_loader(tmp_path: Path, make_pdf) -> None:
    from tokrag_integrations.postgres.ingestion import parse_file

    pdf = tmp_path / "manual.pdf"
    make_pdf(pdf, ["The Brannock relay was commissioned in 1987.", "It hums at 50 Hz."])
    (doc,) = load_documents(tmp_path)
    assert doc.text == "The Brannock relay was commissioned in 1987.\n\nIt hums at 50 Hz."
    assert doc.metadata == {"file_name": "manual.pdf", "format": "pdf"}
    ingested, notes = parse_file(pdf)  # tokrag ingest reads it the same way
    assert (ingested.text, ingested.metadata, notes) == (doc.text, doc.metadata, [])


def test_binary_and_broken_files_are_skipped_with_a_message(tmp_path: Path) -> None:
    (tmp_path / "ok.md").write_text("# Ok\n\nFine.", encoding="utf-8")
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02PK\x03\x04" * 50)
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7\nthis is not really a pdf\n%%EOF")
    with pytest.warns(UserWarning) as record:
        docs = load_documents(tmp_path)
    assert [d.metadata["file_name"] for d in docs] == ["ok.md"]
    messages = [str(w.message) for w in record]
    assert any("blob.txt: looks binary" in m and m.endswith("skipped.") for m in messages)
    assert any("broken.pdf: " in m and "PDF" in m and m.endswith("skipped.") for m in messages)


def test_empty_and_unreadable_files_warn_and_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "ok.txt").write_text("fine", encoding="utf-8")
    locked = tmp_path / "locked.txt"
    locked.write_text("hidden", encoding="utf-8")
    locked.chmod(0)
    try:
        unreadable = not os.access(locked, os.R_OK)
        with pytest.warns(UserWarning) as record:
            docs = load_documents(tmp_path)
    finally:
        locked.chmod(0o644)
    messages = [str(w.message) for w in record]
    assert any("empty.txt" in m and "no text" in m for m in messages)
    if unreadable:  # root can read anything
        assert any("locked.txt" in m and "could not be read" in m for m in messages)
        assert [d.text for d in docs] == ["fine"]


def test_loading_errors_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_documents(missing)
    (tmp_path / "only.json").write_text("{}", encoding="utf-8")
    with (
        pytest.warns(UserWarning, match="other types skipped"),
        pytest.raises(ValueError, match=f"No documents found in {tmp_path}"),
    ):
        load_documents(tmp_path)
    with pytest.raises(ValueError, match="Unsupported document type.*only.json"):
        load_documents(tmp_path / "only.json")
    with pytest.raises(ValueError, match="No document paths"):
        load_documents([])


# ------------------------------------------------------------------------ chunking
def test_short_text_is_one_chunk() -> None:
    assert chunk_text("One paragraph.\n\nTwo paragraphs.") == ["One paragraph.\n\nTwo paragraphs."]
    assert chunk_text("   \n\n ") == []


def test_chunks_break_at_paragraphs() -> None:
    paras = [f"Paragraph {i} " + "word " * 30 for i in range(6)]
    text = "\n\n".join(p.strip() for p in paras)
    chunks = chunk_text(text, max_chars=400, overlap=0)
    assert len(chunks) > 1
    for c in chunks:
        assert len(c) <= 400
        assert c.startswith("Paragraph") and c.endswith("word")
    assert "\n\n".join(chunks) == text  # no overlap: nothing lost, nothing repeated


def test_long_paragraph_breaks_at_sentences_with_overlap() -> None:
    sentences = [f"Sentence number {i} says something fairly specific." for i in range(40)]
    text = " ".join(sentences)
    chunks = chunk_text(text, max_chars=300, overlap=100)
    assert len(chunks) > 3
    for c in chunks:
        assert len(c) <= 300
        assert c.startswith("Sentence number") and c.endswith("specific.")
    for prev, nxt in zip(chunks, chunks[1:], strict=False):
        first_sentence = nxt.split(". ")[0] + "."
        assert first_sentence in prev  # the overlap repeats the previous chunk's last sentence
    for s in sentences:
        assert any(s in c for c in chunks)


def test_huge_word_is_hard_split() -> None:
    chunks = chunk_text("x" * 250 + " tail", max_chars=100, overlap=10)
    assert all(len(c) <= 100 for c in chunks)
    assert "".join(c for c in chunks if "tail" not in c).count("x") >= 200
    assert chunks[-1].endswith("tail")


def test_chunk_argument_errors() -> None:
    with pytest.raises(ValueError, match="max_chars must be positive"):
        chunk_text("a", max_chars=0)
    with pytest.raises(ValueError, match="overlap must be"):
        chunk_text("a", max_chars=100, overlap=100)


def test_chunk_documents_carries_source_and_index() -> None:
    doc = Document(text="A. " * 400, source="x.txt", metadata={"title": "T"})
    chunks = chunk_documents([doc], max_chars=200, overlap=20)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(c.source == "x.txt" and c.metadata["title"] == "T" for c in chunks)


# ------------------------------------------------------------------------ retrievers
@pytest.fixture(scope="module")
def sample_chunks() -> list[Chunk]:
    return chunk_documents(load_documents(get_sample_docs_path()))


@pytest.fixture(scope="module")
def bm25(sample_chunks: list[Chunk]) -> BM25Retriever:
    return BM25Retriever(sample_chunks)


def test_bm25_ignores_chunks_without_shared_words(bm25: BM25Retriever) -> None:
    assert bm25.retrieve("zyzzyva quaternion", top_k=3) == []
    assert bm25.retrieve("the of and", top_k=3) == []  # stopwords only


def test_build_retriever_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Unknown retriever 'sparse'; use 'dense', 'bm25' or 'hybrid'"):
        build_retriever(tmp_path, kind="sparse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"No documents found in {tmp_path}"):
        build_retriever(tmp_path)
    with pytest.raises(ValueError, match="no chunks to index"):
        BM25Retriever([])
