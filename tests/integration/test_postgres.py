"""Postgres + pgvector: ingestion, retrieval through LlamaIndex and LangChain, faults, hostile
input.

Everything marked ``postgres`` runs against a real PostgreSQL 16 + pgvector started once per
test session by ``pgserver`` in a temporary folder. Run only these with
``pytest -m postgres tests/integration/test_postgres.py``.

Cases that need no model, database or server are in ``tests/unit/test_postgres.py``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _helpers import CheckedThread, join_all, require

HOSTILE_NAMES = [
    'docs"; DROP TABLE data_tokrag_docs; --',
    "docs'",
    "a;b",
    "tåble",
    "Robert'); DROP TABLE students;--",
    "with space",
    "",
    "x" * 41,
]
HOSTILE_VALUES = ["x' OR '1'='1", "a'; DROP TABLE data_t; --", "日本語; '\"", "%", "\\"]
WIFI_Q = "What is the guest Wi-Fi network at the Dundee office called?"
WIFI_A = "QF-Guest-Larch"


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def pg_dsn(module_pg_dsn):
    """This module's database on the run's shared embedded PostgreSQL + pgvector."""
    return module_pg_dsn


@pytest.fixture(scope="session")
def docs_dir(tmp_path_factory):
    """A private copy of the sample documents (tests edit it)."""
    from tokrag_integrations.retrieval import get_sample_docs_path

    dst = tmp_path_factory.mktemp("docs") / "sample_docs"
    shutil.copytree(get_sample_docs_path(), dst)
    return dst


def _expected_chunks(paths):
    from tokrag_integrations.postgres.ingestion import parse_file
    from tokrag_integrations.retrieval import chunk_text

    return {str(Path(p).resolve()): len(chunk_text(parse_file(p)[0].text)) for p in paths}


@pytest.fixture(scope="module")
def sample_kb(pg_dsn, docs_dir):
    """The sample documents ingested into table ``sample`` (once)."""
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    summary = ingest([docs_dir], dsn=pg_dsn, table="sample", progress=False)
    kb = PostgresKnowledgeBase(pg_dsn, "sample")
    kb.first_summary = summary
    yield kb
    kb.close()


def _ids_by_source(kb):
    from tokrag_integrations.postgres.connection import connect

    with connect(kb.db.dsn, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT metadata_->>'source', node_id FROM {kb.layout.table}"
        ).fetchall()
    out: dict[str, set[str]] = {}
    for source, node_id in rows:
        out.setdefault(source, set()).add(node_id)
    return out


# ============================================================================ ingestion
@pytest.mark.postgres
def test_ingest_counts_match(sample_kb, docs_dir):
    summary = sample_kb.first_summary
    files = sorted(p for p in docs_dir.iterdir() if p.is_file())
    expected = _expected_chunks(files)
    assert summary.added == len(files) == 9
    assert not summary.failed and summary.replaced == 0
    assert summary.chunks_written == sum(expected.values())
    assert sample_kb.count() == sum(expected.values())
    for source, n in expected.items():
        assert sample_kb.count(source) == n
    # metadata: source path, chunk numbers 0..n-1, one content hash per file
    from tokrag_integrations.postgres.connection import connect

    with connect(sample_kb.db.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT metadata_->>'source', array_agg((metadata_->>'chunk')::int ORDER BY 1), "
            "count(DISTINCT metadata_->>'content_hash') FROM data_sample GROUP BY 1"
        ).fetchall()
        index_defs = [
            r[0]
            for r in conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE tablename = 'data_sample'"
            ).fetchall()
        ]
    for source, chunk_numbers, hashes in rows:
        assert sorted(chunk_numbers) == list(range(expected[source])) and hashes == 1
    assert any("USING hnsw (embedding vector_cosine_ops)" in d for d in index_defs)


@pytest.mark.postgres
def test_second_ingest_adds_nothing(sample_kb, docs_dir, pg_dsn):
    from tokrag_integrations.postgres import ingest

    before = _ids_by_source(sample_kb)
    summary = ingest([docs_dir], dsn=pg_dsn, table="sample", progress=False)
    assert summary.unchanged == 9 and summary.added == summary.replaced == 0
    assert summary.chunks_written == 0 and summary.embed_seconds == 0
    assert _ids_by_source(sample_kb) == before


@pytest.mark.postgres
def test_edited_file_replaces_exactly_its_chunks(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval import get_sample_docs_path

    docs = tmp_path / "docs"
    shutil.copytree(get_sample_docs_path(), docs)
    ingest([docs], dsn=pg_dsn, table="edits", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "edits") as kb:
        before = _ids_by_source(kb)
        edited = (docs / "glossary.md").resolve()
        edited.write_text(
            edited.read_text() + "\n\n## Zanderflux\n\nThe Zanderflux valve was retired in 2019.\n"
        )
        summary = ingest([docs], dsn=pg_dsn, table="edits", progress=False)
        assert (summary.replaced, summary.unchanged, summary.added) == (1, 8, 0)
        report = next(f for f in summary.files if f.status == "replaced")
        assert report.path == str(edited) and report.removed == len(before[str(edited)])
        after = _ids_by_source(kb)
        for source, ids in before.items():
            if source != str(edited):
                assert after[source] == ids  # untouched files keep their rows
        assert after[str(edited)].isdisjoint(before[str(edited)])
        assert len(after[str(edited)]) == _expected_chunks([edited])[str(edited)]
        hits = kb.retrieve("When was the Zanderflux valve retired?", top_k=1)
        assert "2019" in hits[0].text and hits[0].source == str(edited)


@pytest.mark.postgres
def test_parse_failure_reported_and_skipped(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval import supported_types

    (tmp_path / "good.md").write_text("# Good\n\nThe Ostrander beacon blinks every 7 seconds.\n")
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02PK\x03\x04" * 100)
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.7\nthis is not really a pdf\n%%EOF")
    (tmp_path / "empty.md").write_text("   \n")
    (tmp_path / "notes.docx").write_bytes(b"PK\x03\x04")
    with pytest.warns(UserWarning, match=r"1 file\(s\) of other types skipped \(\.docx\)"):
        summary = ingest([tmp_path], dsn=pg_dsn, table="faults", progress=False)
    failed = {Path(f.path).name: f.reason for f in summary.failed}
    assert set(failed) == {"binary.txt", "broken.pdf", "empty.md"}
    assert "binary" in failed["binary.txt"] and "no text" in failed["empty.md"]
    assert summary.added == 1
    assert "skipped" in summary.to_text() and "broken.pdf" in summary.to_text()
    named = [tmp_path / "notes.docx", tmp_path / "good.md"]  # a type named directly: one line
    summary = ingest(named, dsn=pg_dsn, table="faults", progress=False)
    assert [(Path(f.path).name, f.reason) for f in summary.failed] == [
        ("notes.docx", f"unsupported type (supported: {supported_types()})")
    ]
    assert summary.unchanged == 1
    with PostgresKnowledgeBase(pg_dsn, "faults") as kb:
        assert kb.count() == 1


@pytest.mark.postgres
def test_exception_between_delete_and_insert_leaves_old_chunks(pg_dsn, tmp_path, monkeypatch):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest, ingestion

    for name in ("a.md", "b.md", "c.md"):
        (tmp_path / name).write_text(f"# {name}\n\nOriginal text of {name}.\n")
    ingest([tmp_path], dsn=pg_dsn, table="atomic", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "atomic") as kb:
        before = _ids_by_source(kb)
        for name in ("a.md", "b.md"):
            (tmp_path / name).write_text(f"# {name}\n\nNew text of {name}.\n\nMore.\n")
        real_rows = ingestion._rows

        def failing_rows(layout, prep, embeddings):  # runs after the DELETE, before INSERT
            if prep.source.endswith("b.md"):
                raise RuntimeError("injected failure between delete and insert")
            return real_rows(layout, prep, embeddings)

        monkeypatch.setattr(ingestion, "_rows", failing_rows)
        with pytest.raises(RuntimeError, match="injected"):
            ingest([tmp_path], dsn=pg_dsn, table="atomic", progress=False)
        after = _ids_by_source(kb)
        b = str((tmp_path / "b.md").resolve())
        a = str((tmp_path / "a.md").resolve())
        assert after[b] == before[b]  # b rolled back to its old chunks, not empty
        assert after[a] != before[a]  # a (before the failure) committed
        monkeypatch.setattr(ingestion, "_rows", real_rows)
        summary = ingest([tmp_path], dsn=pg_dsn, table="atomic", progress=False)
        assert (summary.replaced, summary.unchanged) == (1, 2)


@pytest.mark.postgres
def test_killed_ingest_leaves_no_partial_file(pg_dsn, tmp_path):
    """SIGKILL the ingesting process after it deleted a file's chunks, before it committed."""
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    docs = tmp_path / "docs"
    docs.mkdir()
    body = "\n\n".join(
        f"Paragraph {i} about the Halvorsen pump, serial {i * 7}." for i in range(60)
    )
    (docs / "pump.md").write_text(f"# Pump\n\n{body}\n")
    ingest([docs], dsn=pg_dsn, table="killed", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "killed") as kb:
        before = _ids_by_source(kb)
        (docs / "pump.md").write_text(f"# Pump v2\n\n{body}\n\nRevised.\n")
        marker = tmp_path / "deleted.marker"
        script = textwrap.dedent(
            f"""
            import time
            from pathlib import Path
            from tokrag_integrations.postgres import ingest, ingestion
            real = ingestion._rows
            def slow_rows(layout, prep, embeddings):
                rows = real(layout, prep, embeddings)
                Path({str(marker)!r}).write_text("deleted")  # the DELETE has run
                time.sleep(120)
                return rows
            ingestion._rows = slow_rows
            ingest([{str(docs)!r}], dsn={pg_dsn!r}, table="killed", progress=False)
            """
        )
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen([sys.executable, "-c", script], env=env)
        try:
            deadline = time.monotonic() + 240
            while not marker.exists():
                assert proc.poll() is None, "ingest subprocess exited early"
                assert time.monotonic() < deadline, "ingest subprocess never reached the write"
                time.sleep(0.2)
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
        for _ in range(50):  # the server notices the dead client and rolls back
            after = _ids_by_source(kb)
            if after == before:
                break
            time.sleep(0.2)
        assert after == before
        summary = ingest([docs], dsn=pg_dsn, table="killed", progress=False)
        assert summary.replaced == 1
        assert "Revised." in kb.retrieve("Revised pump", top_k=40)[0].text or any(
            "Revised." in c.text for c in kb.retrieve("Revised", top_k=40)
        )


# ============================================================================ retrieval
@pytest.mark.postgres
def test_metadata_filter_restricts(sample_kb):
    unfiltered = sample_kb.retrieve(WIFI_Q, top_k=3)
    assert unfiltered[0].metadata["file_name"] == "visitor_guide.html"
    hits = sample_kb.retrieve(WIFI_Q, top_k=5, filters={"file_name": "leave_policy.md"})
    assert hits and {h.metadata["file_name"] for h in hits} == {"leave_policy.md"}
    both = sample_kb.retrieve(
        WIFI_Q, top_k=8, filters=["file_name=leave_policy.md", "file_name=offices.md"]
    )
    assert {h.metadata["file_name"] for h in both} == {"leave_policy.md", "offices.md"}
    nodes = sample_kb.llamaindex_retriever(5, filters={"format": "md"}).retrieve(WIFI_Q)
    assert nodes and all(n.node.metadata["format"] == "md" for n in nodes)
    docs = sample_kb.langchain_retriever(5, filters=["file_name=products.md"]).invoke(WIFI_Q)
    assert docs and {d.metadata["file_name"] for d in docs} == {"products.md"}


@pytest.mark.postgres
@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_hostile_filter_values_are_parameterised(sample_kb, value):
    assert sample_kb.retrieve(WIFI_Q, top_k=3, filters={"file_name": value}) == []
    assert sample_kb.llamaindex_retriever(3, filters={"file_name": value}).retrieve(WIFI_Q) == []
    assert sample_kb.langchain_retriever(3, filters={"file_name": value}).invoke(WIFI_Q) == []
    assert sample_kb.count() > 0  # nothing was dropped or deleted


@pytest.mark.postgres
def test_hostile_names_in_metadata_match_exactly(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    odd = 'Zoë\'s notes; DROP TABLE x; -- "q".md'
    (tmp_path / odd).write_text("# Odd\n\nThe Quimby gauge reads 42 kPa.\n")
    (tmp_path / "plain.md").write_text("# Plain\n\nThe Quimby gauge is blue.\n")
    summary = ingest([tmp_path], dsn=pg_dsn, table="hostile", progress=False)
    assert summary.added == 2
    with PostgresKnowledgeBase(pg_dsn, "hostile") as kb:
        for hits in (
            kb.retrieve("Quimby gauge", top_k=5, filters={"file_name": odd}),
            [n.node for n in kb.llamaindex_retriever(5, {"file_name": odd}).retrieve("Quimby")],
            kb.langchain_retriever(5, {"file_name": odd}).invoke("Quimby gauge"),
        ):
            texts = [getattr(h, "page_content", None) or h.text for h in hits]
            assert len(texts) == 1 and "42 kPa" in texts[0]
    for name in HOSTILE_NAMES[:5]:
        with pytest.raises(ValueError, match="Invalid table name"):
            ingest([tmp_path], dsn=pg_dsn, table=name, progress=False)
        with pytest.raises(ValueError, match="Invalid table name"):
            PostgresKnowledgeBase(pg_dsn, name)


@pytest.mark.postgres
def test_missing_table_is_a_clear_error(pg_dsn):
    from tokrag_integrations.postgres import PostgresKnowledgeBase

    with pytest.raises(LookupError, match="tokrag ingest"):
        PostgresKnowledgeBase(pg_dsn, "never_ingested")


@pytest.mark.postgres
def test_langchain_target_layout(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    (tmp_path / "a.md").write_text("# A\n\nThe Pelling crane lifts 30 tonnes.\n")
    summary = ingest([tmp_path], dsn=pg_dsn, table="lc_native", target="langchain", progress=False)
    assert summary.added == 1
    again = ingest([tmp_path], dsn=pg_dsn, table="lc_native", target="langchain", progress=False)
    assert again.unchanged == 1
    with PostgresKnowledgeBase(pg_dsn, "lc_native") as kb:
        assert kb.layout.target == "langchain" and kb.layout.table == "lc_native"
        assert "30 tonnes" in kb.retrieve("How much does the crane lift?", top_k=1)[0].text
        docs = kb.langchain_retriever(1).invoke("crane")
        assert docs[0].metadata["file_name"] == "a.md"


# ============================================================================ answers
@pytest.mark.postgres
def test_answer_through_llamaindex(sample_kb, lm):
    from llama_index.core.query_engine import RetrieverQueryEngine

    from tokrag_integrations.llama_index import TokRAGSynthesizer

    engine = RetrieverQueryEngine(
        sample_kb.llamaindex_retriever(top_k=3),
        response_synthesizer=TokRAGSynthesizer(lm, policy="rag", max_new_tokens=24),
    )
    response = engine.query(WIFI_Q)
    assert WIFI_A in str(response)
    assert response.source_nodes[0].node.metadata["file_name"] == "visitor_guide.html"


@pytest.mark.postgres
def test_answer_through_langchain(sample_kb, lm):
    langchain_mod = require("tokrag_integrations.langchain", "langchain-core")
    retriever = sample_kb.langchain_retriever(k=3)
    chain = langchain_mod.create_tokrag_chain(retriever, lm, policy="rag", max_tokens=24)
    out = chain.invoke(WIFI_Q)
    text = out if isinstance(out, str) else out.get("answer", out.get("result", str(out)))
    assert WIFI_A in str(text)


@pytest.mark.postgres
def test_answer_from_postgres_function(sample_kb, lm):
    from tokrag_integrations.postgres import answer_from_postgres

    result, chunks = answer_from_postgres(
        WIFI_Q, sample_kb.db.dsn, "sample", None, "rag", 3, lm, max_new_tokens=24
    )
    assert WIFI_A in result.text and chunks[0].metadata["file_name"] == "visitor_guide.html"
    assert [(p.metadata["node_id"], p.metadata["source"]) for p in result.trace.passages] == [
        (c.node_id, c.source) for c in chunks
    ]
    filtered = answer_from_postgres(
        WIFI_Q,
        sample_kb.db.dsn,
        "sample",
        ["file_name=leave_policy.md"],
        "rag",
        2,
        lm,
        max_new_tokens=8,
    )
    assert {c.metadata["file_name"] for c in filtered.chunks} == {"leave_policy.md"}


@pytest.mark.postgres
def test_cli_answer_cites_chunk_ids_and_sources(sample_kb, lm, tmp_path, capsys):
    """``tokrag ask --store postgres``: each citation of the JSON trace names a chunk's row id
    (stored under its source in the table) and ``--sources`` shows each chunk's id."""
    from _helpers import sharing_model

    from tokrag_integrations.cli import main

    path = tmp_path / "trace.json"
    argv = ["ask", WIFI_Q, "--store", "postgres", "--dsn", sample_kb.db.dsn, "--table",
            "sample", "--top-k", "3", "--max-new-tokens", "8", "--sources",
            "--json", str(path)]  # fmt: skip
    with sharing_model(lm):
        assert main(argv) == 0
    trace = json.loads(path.read_text())
    ids = _ids_by_source(sample_kb)
    assert trace["citations"] and all(
        c["metadata"]["node_id"] in ids[c["source"]] for c in trace["citations"]
    )
    shown = "".join(capsys.readouterr().out.split())  # the console wraps long lines
    for p in trace["passages"]:
        assert f"id{p['metadata']['node_id']}" in shown


@pytest.mark.postgres
def test_eight_threads_query_concurrently(sample_kb, lm):
    """8 threads retrieve + generate at once; each gets chunks of the file holding its answer
    and exactly the chunks and answer a sequential run gives (greedy decoding is deterministic, so any
    cross-talk between threads would show). Answer quality itself is checked by the
    single-question tests: 6 tokens are too few for the 135M model to finish most answers, and
    enough for a mixed-up context to show."""
    from tokrag_integrations.retrieval import get_sample_questions

    questions = get_sample_questions()[:8]

    def ask(q):
        answer = sample_kb.answer(q["question"], lm, policy="rag", top_k=3, max_new_tokens=6)
        return (
            [c.node_id for c in answer.chunks],
            [c.metadata["file_name"] for c in answer.chunks],
            answer.result.text,
        )

    sequential = [ask(q) for q in questions]
    results: dict[int, tuple] = {}
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = ask(questions[i])

    threads = [CheckedThread(target=worker, args=(i,), name=f"ask {i}") for i in range(8)]
    for t in threads:
        t.start()
    join_all(threads, 600)
    for i, q in enumerate(questions):
        ids, files, answer = results[i]
        assert q["source"] in files, (q["question"], files)
        assert (ids, answer) == (sequential[i][0], sequential[i][2]), q["question"]
