"""Postgres search modes, filter operators, the shared pool, async retrieval, and reading the
frameworks' own tables (``PGVectorStore(hybrid_search=True)``, the older ``PGVector``).

Everything marked ``postgres`` runs against a real PostgreSQL 16 + pgvector started once for
this module by ``pgserver`` in a temporary folder.

Cases that need no model, database or server are in ``tests/unit/test_pg_search.py``."""

from __future__ import annotations

import asyncio
import threading

import pytest
from _helpers import CheckedThread, join_all

HOSTILE_VALUES = ["x' OR '1'='1", "a'; DROP TABLE data_ops; --", "日本語; '\"", "%", "\\", ")) OR TRUE --"]

# Twelve support notes that differ only in the ticket number and the fix's value: embeddings
# see twelve near-identical texts; the ticket number is what tells them apart.
TICKETS = [f"INC-{n}" for n in (40213, 40288, 40317, 40392, 40455, 40519, 40583, 40641, 40707, 40766, 40834, 40899)]
TIMEOUTS = [17, 23, 31, 38, 44, 52, 59, 63, 71, 78, 86, 93]


def _ticket_note(ticket: str, seconds: int) -> str:
    return (
        f"# Ticket {ticket}\n\nTicket {ticket}: the nightly export of the billing database to the "
        f"reporting warehouse stopped with a lock timeout. The fix for ticket {ticket} was to "
        f"raise the export job's lock wait to {seconds} seconds.\n"
    )


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def pg_dsn(module_pg_dsn):
    """This module's database on the run's shared embedded PostgreSQL + pgvector."""
    return module_pg_dsn


@pytest.fixture(scope="module")
def tickets(pg_dsn, tmp_path_factory):
    """The twelve near-identical ticket notes, ingested into table ``tickets``."""
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    folder = tmp_path_factory.mktemp("tickets")
    for ticket, seconds in zip(TICKETS, TIMEOUTS, strict=True):
        (folder / f"{ticket.lower()}.md").write_text(_ticket_note(ticket, seconds))
    assert ingest([folder], dsn=pg_dsn, table="tickets", progress=False).added == len(TICKETS)
    kb = PostgresKnowledgeBase(pg_dsn, "tickets")
    yield kb
    kb.close()


@pytest.fixture(scope="module")
def ops(pg_dsn, tmp_path_factory):
    """Documents with typed metadata for the filter operators (written with PGVectorStore)."""
    from llama_index.core.schema import TextNode

    from tokrag_integrations.postgres import PostgresKnowledgeBase
    from tokrag_integrations.postgres.connection import resolve_dsn
    from tokrag_integrations.postgres.frameworks import (
        close_llamaindex_store,
        make_llamaindex_store,
    )
    from tokrag_integrations.postgres.layout import TableLayout
    from tokrag_integrations.retrieval.embedder import load_embedder

    embedder = load_embedder()
    rows = [
        ("Quarterly audit of the Leith warehouse.", {"year": 2019, "status": "final", "tags": ["audit", "leith"], "title": "Leith audit"}),
        ("Quarterly audit of the Dundee office.", {"year": 2021, "status": "draft", "tags": ["audit"], "title": "Dundee audit"}),
        ("Fire drill report for the Perth depot.", {"year": 2022, "status": "final", "tags": ["safety"], "title": "Perth drill"}),
        ("Fire drill report for the Leith warehouse.", {"year": 2024, "status": "final", "tags": ["safety", "leith"], "title": "Leith drill"}),
        ("Visitor badge policy (no year).", {"status": "draft", "title": "Badges"}),
    ]
    nodes = []
    for i, (text, meta) in enumerate(rows):
        node = TextNode(id_=f"ops-{i}", text=text, metadata={**meta, "embed_model": embedder.name})
        node.embedding = embedder.embed_query(text)
        nodes.append(node)
    db = resolve_dsn(pg_dsn)
    store = make_llamaindex_store(db, TableLayout.for_target("ops"), embedder.dim, setup=True, hybrid_search=True)
    try:
        store.add(nodes)
    finally:
        close_llamaindex_store(store)
    kb = PostgresKnowledgeBase(pg_dsn, "ops")
    yield kb
    kb.close()


# ============================================================================ search modes
@pytest.mark.postgres
def test_new_table_has_generated_tsvector_with_gin_index(tickets):
    from tokrag_integrations.postgres.connection import connect

    assert tickets.layout.tsv_column == "text_search_tsv" and tickets.layout.ts_config == "english"
    with connect(tickets.db.dsn, autocommit=True) as conn:
        defs = [r[0] for r in conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = 'data_tickets'")]
        generated = conn.execute(
            "SELECT attgenerated FROM pg_attribute WHERE attrelid = 'data_tickets'::regclass "
            "AND attname = 'text_search_tsv'"
        ).fetchone()[0]
    assert generated == "s"  # GENERATED ALWAYS ... STORED
    assert any("USING gin (text_search_tsv)" in d for d in defs)
    assert any("USING hnsw (embedding vector_cosine_ops)" in d for d in defs)


@pytest.mark.postgres
def test_each_search_mode_and_identifier_ranking(tickets):
    """Hybrid puts the ticket the question names first for all twelve; vector search, which
    sees twelve near-identical texts, does not."""
    vector_right = hybrid_right = text_right = 0
    for ticket in TICKETS:
        question = f"What was the fix for ticket {ticket}?"
        expected = f"Ticket {ticket}:"
        vector = tickets.retrieve(question, top_k=3, search="vector")
        text = tickets.retrieve(question, top_k=3, search="text")
        hybrid = tickets.retrieve(question, top_k=3, search="hybrid")
        assert len(vector) == len(text) == len(hybrid) == 3
        assert all(-1 <= c.score <= 1 for c in vector)
        assert [c.score for c in hybrid] == sorted((c.score for c in hybrid), reverse=True)
        vector_right += expected in vector[0].text
        text_right += expected in text[0].text
        hybrid_right += expected in hybrid[0].text
    assert hybrid_right == len(TICKETS) and text_right == len(TICKETS)
    assert vector_right < len(TICKETS) - 2, vector_right


@pytest.mark.postgres
def test_hybrid_fusion_options_and_framework_retrievers(tickets):
    q = f"What was the fix for ticket {TICKETS[5]}?"
    text_only = tickets.retrieve(q, top_k=5, search="hybrid", vector_weight=0.0)
    assert [c.node_id for c in text_only] == [c.node_id for c in tickets.retrieve(q, top_k=5, search="text")]
    vector_only = tickets.retrieve(q, top_k=5, search="hybrid", text_weight=0.0, candidates=100)
    assert [c.node_id for c in vector_only] == [c.node_id for c in tickets.retrieve(q, top_k=5, search="vector")]
    fused = tickets.retrieve(q, top_k=1, search="hybrid", rrf_k=1)[0]
    rv, rt = (_rank(tickets, q, fused.node_id, mode) for mode in ("vector", "text"))
    assert fused.score == pytest.approx(1 / (1 + rv) + 1 / (1 + rt))
    nodes = tickets.llamaindex_retriever(2, search="hybrid").retrieve(q)
    assert f"Ticket {TICKETS[5]}:" in nodes[0].node.get_content() and nodes[0].node.metadata["file_name"]
    from llama_index.core.schema import MetadataMode

    assert nodes[0].node.get_content(MetadataMode.LLM) == nodes[0].node.text  # no metadata in prompts
    docs = tickets.langchain_retriever(2, search="text").invoke(q)
    assert f"Ticket {TICKETS[5]}:" in docs[0].page_content
    for bad, message in (
        ({"search": "keyword"}, "Unknown search"),
        ({"rrf_k": 0}, "rrf_k must be positive"),
        ({"vector_weight": -1}, "vector_weight must be >= 0"),
        ({"vector_weight": 0, "text_weight": 0}, "both 0"),
        ({"candidates": 0}, "candidates must be between"),
    ):
        with pytest.raises(ValueError, match=message):
            tickets.retrieve(q, **bad)
        with pytest.raises(ValueError, match=message):
            tickets.llamaindex_retriever(2, **bad)


def _rank(kb, question, node_id, search):
    """1-based rank of ``node_id`` in one search mode (for the RRF arithmetic check)."""
    ids = [c.node_id for c in kb.retrieve(question, top_k=50, search=search)]
    return ids.index(node_id) + 1


@pytest.mark.postgres
def test_text_search_config_is_selectable_and_checked(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    (tmp_path / "a.md").write_text("# A\n\nThe running pumps were stopped.\n")
    ingest([tmp_path], dsn=pg_dsn, table="simple_cfg", text_search_config="simple", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "simple_cfg") as kb:
        assert kb.layout.ts_config == "simple"
        assert kb.retrieve("running", search="text")  # the same word
        assert kb.retrieve("run", search="text") == []  # no stemming in 'simple'
    with pytest.raises(ValueError, match="no text search configuration 'klingon'"):
        ingest([tmp_path], dsn=pg_dsn, table="bad_cfg", text_search_config="klingon", progress=False)
    with pytest.raises(ValueError, match="Invalid text search configuration"):
        ingest([tmp_path], dsn=pg_dsn, table="bad_cfg", text_search_config="english'); --", progress=False)


@pytest.mark.postgres
def test_old_table_is_upgraded_on_request(pg_dsn, tmp_path, capsys):
    """A table made before the full-text column existed: a clear message, then --upgrade."""
    from tokrag_integrations.cli.pg import add_ingest_parser
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.postgres.connection import connect

    (tmp_path / "a.md").write_text("# A\n\nValve ZX-9 opens at 4 bar.\n")
    ingest([tmp_path], dsn=pg_dsn, table="old", progress=False)
    with connect(pg_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE data_old DROP COLUMN text_search_tsv")  # as tokrag made it before
    with PostgresKnowledgeBase(pg_dsn, "old") as kb:
        assert kb.retrieve("valve", search="vector")
        with pytest.raises(ValueError, match="needs a full-text column.*--upgrade"):
            kb.retrieve("valve", search="hybrid")
        summary = ingest([tmp_path], dsn=pg_dsn, table="old", progress=False)
        assert "no full-text column" in summary.to_text() and "--upgrade" in summary.to_text()
        import argparse

        parser = argparse.ArgumentParser()
        add_ingest_parser(parser.add_subparsers())
        args = parser.parse_args(["ingest", str(tmp_path), "--dsn", pg_dsn, "--table", "old", "--upgrade", "--no-progress"])
        assert args.func(args) == 0
        assert "added the full-text column (english)" in capsys.readouterr().out
        hits = kb.retrieve("ZX-9", search="text")  # found again without reopening
        assert hits and "4 bar" in hits[0].text


# ============================================================================ filters
@pytest.mark.postgres
@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"status": {"$eq": "final"}}, {"Leith audit", "Perth drill", "Leith drill"}),
        ({"status": {"$ne": "final"}}, {"Dundee audit", "Badges"}),
        ({"year": {"$ne": 2021}}, {"Leith audit", "Perth drill", "Leith drill", "Badges"}),
        ({"year": {"$in": [2019, 2024]}}, {"Leith audit", "Leith drill"}),
        ({"title": {"$nin": ["Badges", "Perth drill"]}}, {"Leith audit", "Dundee audit", "Leith drill"}),
        ({"year": {"$gt": 2021}}, {"Perth drill", "Leith drill"}),
        ({"year": {"$gte": 2021}}, {"Dundee audit", "Perth drill", "Leith drill"}),
        ({"year": {"$lt": 2021}}, {"Leith audit"}),
        ({"year": {"$lte": 2021}}, {"Leith audit", "Dundee audit"}),
        ({"year": {"$gte": 2020, "$lt": 2024}}, {"Dundee audit", "Perth drill"}),
        ({"tags": {"$contains": "leith"}}, {"Leith audit", "Leith drill"}),
        ({"title": {"$contains": "drill"}}, {"Perth drill", "Leith drill"}),
        ({"title": {"$gt": "Leith"}}, {"Leith audit", "Leith drill", "Perth drill"}),
        (["year>=2022", "tags~=safety"], {"Perth drill", "Leith drill"}),
    ],
)
@pytest.mark.parametrize("search", ["vector", "text", "hybrid"])
def test_filter_operators(ops, filters, expected, search):
    query = "audit drill policy report warehouse office depot badge"
    hits = ops.retrieve(query, top_k=10, filters=filters, search=search)
    if search == "text":  # only rows sharing a word with the query
        assert {h.metadata["title"] for h in hits} <= expected and hits
    else:
        assert {h.metadata["title"] for h in hits} == expected


STATUS = {"Leith audit": "final", "Dundee audit": "draft", "Perth drill": "final", "Leith drill": "final", "Badges": "draft"}
ORACLE = {  # what each operator means for a text value, in Python (C collation = code points)
    "$eq": lambda s, v: s == v,
    "$ne": lambda s, v: s != v,
    "$in": lambda s, v: s == v,
    "$nin": lambda s, v: s != v,
    "$gt": lambda s, v: s > v,
    "$gte": lambda s, v: s >= v,
    "$lt": lambda s, v: s < v,
    "$lte": lambda s, v: s <= v,
    "$contains": lambda s, v: v in s,
}


@pytest.mark.postgres
@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_hostile_value_for_each_operator(ops, value):
    """Each operator with a hostile value selects exactly the rows Python's comparison of
    the literal value selects: nothing of the value is read as SQL."""
    before = ops.count()
    # Text search keeps only the rows sharing a word with the query.
    with_word = {h.metadata["title"] for h in ops.retrieve("audit", top_k=10, search="text")}
    assert with_word and with_word < set(STATUS)
    for op, holds in ORACLE.items():
        spec = {op: [value] if op in ("$in", "$nin") else value}
        expected = {t for t, status in STATUS.items() if holds(status, value)}
        for search in ("vector", "hybrid", "text"):
            hits = ops.retrieve("audit", top_k=10, filters={"status": spec}, search=search)
            want = expected & with_word if search == "text" else expected
            assert {h.metadata["title"] for h in hits} == want, (op, search)
    # The value as the query of a text search is words to look for, never SQL.
    for search in ("text", "hybrid"):
        assert {h.metadata["title"] for h in ops.retrieve(value, top_k=10, search=search)} <= set(STATUS)
    assert ops.llamaindex_retriever(5, {"status": value}).retrieve("audit") == []
    assert ops.langchain_retriever(5, {"status": {"$contains": value}}).invoke("audit") == []
    assert ops.count() == before


@pytest.mark.postgres
def test_llamaindex_store_subclass_binds_contains_any_all(ops):
    from llama_index.core.vector_stores.types import (
        FilterOperator,
        MetadataFilter,
        MetadataFilters,
        VectorStoreQuery,
    )

    store = ops.llamaindex_store()

    def titles(op, value):
        flt = MetadataFilters(filters=[MetadataFilter(key="tags", value=value, operator=op)])
        result = store.query(
            VectorStoreQuery(query_embedding=ops.embedder.embed_query("audit"), similarity_top_k=10, filters=flt)
        )
        return {n.metadata["title"] for n in result.nodes}

    assert titles(FilterOperator.CONTAINS, "leith") == {"Leith audit", "Leith drill"}
    assert titles(FilterOperator.ANY, ["audit", "safety"]) == {"Leith audit", "Dundee audit", "Perth drill", "Leith drill"}
    assert titles(FilterOperator.ALL, ["safety", "leith"]) == {"Leith drill"}
    for value in HOSTILE_VALUES:
        assert titles(FilterOperator.CONTAINS, value) == set()
        assert titles(FilterOperator.ANY, [value, "x"]) == set()
    assert ops.count() == 5


# ============================================================================ frameworks' tables
@pytest.mark.postgres
def test_pgvectorstore_hybrid_table_is_read_as_it_is(ops):
    """``ops`` was written by LlamaIndex's own PGVectorStore(hybrid_search=True)."""
    assert ops.layout.target == "llamaindex" and ops.layout.tsv_column == "text_search_tsv"
    for search in ("vector", "text", "hybrid"):
        hits = ops.retrieve("fire drill Perth", top_k=2, search=search)
        assert hits[0].metadata["title"] == "Perth drill", search
        assert hits[0].node_id == "ops-2"
    nodes = ops.llamaindex_retriever(1, search="hybrid").retrieve("fire drill Perth")
    assert nodes[0].node.node_id == "ops-2"


@pytest.mark.postgres
def test_legacy_pgvector_collection_is_read(pg_dsn):
    from langchain_postgres import PGVector

    from tokrag_integrations.postgres import PostgresKnowledgeBase
    from tokrag_integrations.postgres.dsn import sqlalchemy_url
    from tokrag_integrations.retrieval.langchain_embeddings import local_embeddings

    embeddings = local_embeddings()
    store = PGVector(
        embeddings=embeddings,
        connection=sqlalchemy_url(pg_dsn),
        collection_name="legacy_notes",
        use_jsonb=True,
    )
    store.add_texts(
        ["The Arbroath kiln fires at 900 degrees.", "Part KX-118 is the kiln door seal.", "Lunch is at noon."],
        metadatas=[{"source": "kiln.md", "chunk": 0}, {"source": "parts.md", "chunk": 3}, {"source": "x.md"}],
        ids=["k1", "k2", "k3"],
    )
    other = PGVector(embeddings=embeddings, connection=sqlalchemy_url(pg_dsn), collection_name="other", use_jsonb=True)
    other.add_texts(["The Arbroath kiln fires at 100 degrees."], ids=["o1"])
    store._engine.dispose()
    other._engine.dispose()
    with PostgresKnowledgeBase(pg_dsn, "legacy_notes") as kb:
        assert kb.layout.target == "langchain_legacy" and kb.count() == 3
        hits = kb.retrieve("How hot does the kiln fire?", top_k=3)
        assert hits[0].text.startswith("The Arbroath kiln fires at 900") and hits[0].node_id == "k1"
        assert "o1" not in {h.node_id for h in hits}  # other collections stay out
        assert kb.retrieve("seal", top_k=3, filters={"chunk": {"$gte": 1}})[0].node_id == "k2"
        with pytest.raises(ValueError, match="needs a full-text column"):
            kb.retrieve("KX-118", search="hybrid")
        kb.add_text_search()
        assert kb.retrieve("KX-118", top_k=1, search="text")[0].node_id == "k2"
        assert kb.retrieve("KX-118", top_k=1, search="hybrid")[0].node_id == "k2"
        with pytest.raises(ValueError, match="legacy langchain-postgres PGVector collection"):
            kb.langchain_store()
        with pytest.raises(ValueError, match="LlamaIndex cannot read it"):
            kb.llamaindex_store()
        docs = kb.langchain_retriever(1).invoke("kiln temperature")
        assert docs[0].id == "k1" and docs[0].metadata["source"] == "kiln.md"
    with PostgresKnowledgeBase(pg_dsn, "whatever", collection="other") as kb:
        assert [h.node_id for h in kb.retrieve("kiln", top_k=5)] == ["o1"]
    with pytest.raises(LookupError, match="no_such"):
        PostgresKnowledgeBase(pg_dsn, "tokrag_docs", collection="no_such")


# ============================================================================ pool and async
@pytest.mark.postgres
def test_sixteen_concurrent_retrievals_share_a_small_pool(tickets):
    from tokrag_integrations.postgres.connection import shared_pool

    questions = [f"What was the fix for ticket {t}?" for t in TICKETS] + ["lock timeout"] * 4
    modes = ["vector", "text", "hybrid", "hybrid"] * 4
    sequential = [[c.node_id for c in tickets.retrieve(q, 3, search=m)] for q, m in zip(questions, modes, strict=True)]
    pool = shared_pool(tickets.db.dsn)
    results: dict[int, list[str]] = {}
    barrier = threading.Barrier(16)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = [c.node_id for c in tickets.retrieve(questions[i], 3, search=modes[i])]

    threads = [CheckedThread(target=worker, args=(i,), name=f"search {i}") for i in range(16)]
    for t in threads:
        t.start()
    join_all(threads, 300)
    assert [results[i] for i in range(16)] == sequential
    from tokrag_integrations.postgres.connection import pooled

    with pooled(tickets.db.dsn) as conn:  # every search planned afresh (no cached generic plan)
        assert conn.prepare_threshold is None and conn.autocommit
    stats = pool.get_stats()
    assert stats["pool_max"] == pool.max_size and stats["pool_size"] <= pool.max_size
    assert stats.get("requests_num", 0) >= 16


@pytest.mark.postgres
def test_pool_settings_are_checked(pg_dsn, monkeypatch):
    from tokrag_integrations.postgres import PostgresKnowledgeBase
    from tokrag_integrations.postgres.dsn import PostgresSetupError

    with pytest.raises(ValueError, match="pool_size must be a positive number"):
        PostgresKnowledgeBase(pg_dsn, "tickets", pool_size=0)
    monkeypatch.setenv("TOKRAG_PG_POOL_TIMEOUT", "soon")
    with pytest.raises(PostgresSetupError, match="TOKRAG_PG_POOL_TIMEOUT"):
        PostgresKnowledgeBase(pg_dsn, "tickets")


@pytest.mark.postgres
def test_async_retrieval(tickets):
    q = [f"What was the fix for ticket {t}?" for t in TICKETS[:6]]

    async def main():
        kb_results = await asyncio.gather(*(tickets.aretrieve(x, 2, search="hybrid") for x in q))
        nodes = await tickets.llamaindex_retriever(2, search="hybrid").aretrieve(q[0])
        docs = await tickets.langchain_retriever(2, search="hybrid").ainvoke(q[1])
        return kb_results, nodes, docs

    kb_results, nodes, docs = asyncio.run(main())
    for ticket, hits in zip(TICKETS[:6], kb_results, strict=True):
        assert f"Ticket {ticket}:" in hits[0].text
    assert f"Ticket {TICKETS[0]}:" in nodes[0].node.get_content()
    assert f"Ticket {TICKETS[1]}:" in docs[0].page_content


@pytest.mark.postgres
def test_async_answer_and_cli_hybrid_answer(tickets, lm, monkeypatch, capsys):
    ticket, seconds = TICKETS[7], TIMEOUTS[7]
    question = f"What was the fix for ticket {ticket}?"
    # vector search alone puts another ticket's note first for this one
    assert f"Ticket {ticket}:" not in tickets.retrieve(question, top_k=1, search="vector")[0].text
    answer = asyncio.run(
        tickets.aanswer(question, lm, policy="rag", top_k=1, search="hybrid", max_new_tokens=40)
    )
    assert f"Ticket {ticket}:" in answer.chunks[0].text and str(seconds) in answer.result.text

    import tokrag_integrations
    from tokrag_integrations.cli import main

    monkeypatch.setattr(tokrag_integrations, "load_model", lambda *a, **k: lm)
    argv = ["ask", question, "--store", "postgres", "--search", "hybrid", "--dsn", tickets.db.dsn,
            "--table", "tickets", "--top-k", "1", "--policy", "rag", "--max-new-tokens", "40"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert str(seconds) in out.out and f"{ticket.lower()}.md #0" in out.err


@pytest.mark.postgres
def test_langchain_layout_has_text_search_too(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    for ticket, seconds in zip(TICKETS[:4], TIMEOUTS, strict=False):
        (tmp_path / f"{ticket}.md").write_text(_ticket_note(ticket, seconds))
    ingest([tmp_path], dsn=pg_dsn, table="lc_tickets", target="langchain", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "lc_tickets") as kb:
        assert kb.layout.target == "langchain" and kb.has_text_search
        for ticket in TICKETS[:4]:
            hits = kb.retrieve(f"What was the fix for ticket {ticket}?", top_k=2, search="hybrid")
            assert f"Ticket {ticket}:" in hits[0].text
        docs = kb.langchain_retriever(1, search="text").invoke(TICKETS[2])
        assert f"Ticket {TICKETS[2]}:" in docs[0].page_content


@pytest.mark.postgres
def test_llamaindex_own_store_runs_its_hybrid_query_on_our_table(tickets):
    """The store ``kb.llamaindex_store()`` gives knows the full-text column, so LlamaIndex's
    own hybrid mode works on a tokrag table too (it raised AttributeError before)."""
    from llama_index.core.vector_stores.types import VectorStoreQuery, VectorStoreQueryMode

    q = f"fix for ticket {TICKETS[3]}"
    result = tickets.llamaindex_store().query(
        VectorStoreQuery(
            query_embedding=tickets.embedder.embed_query(q),
            query_str=TICKETS[3],
            similarity_top_k=3,
            sparse_top_k=3,
            mode=VectorStoreQueryMode.HYBRID,
        )
    )
    assert any(f"Ticket {TICKETS[3]}:" in n.get_content() for n in result.nodes)
