"""Issue 43, the store cases: what a client of the Postgres store (the Python API and
``tokrag serve --store postgres``) can do with bad search input, what it sees of the
server's paths, and how ``tokrag serve`` ends on SIGTERM. Every case runs against a real
embedded PostgreSQL + pgvector (pgserver); the signal case against a real process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import (
    assert_sigterm_stops_postmaster,
    require,
    wait_until_healthy,
)

require("pgserver")

pytestmark = pytest.mark.postgres

DOCS = {
    "leave.md": "Full-time employees at Quillfeather get 27 days of annual leave.",
    "offices.md": "Quillfeather has offices in Lisbon and Tallinn.",
}


@pytest.fixture
def data_folder():
    """A data folder for an embedded server outside pytest's base folder: as root the server
    runs as pgserver's user, and every pytest session (another one, running beside this)
    makes ``/tmp/pytest-of-root`` private again, which would lock that user out of it."""
    import shutil
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="tokrag-store-"))
    parent.chmod(0o755)
    yield parent / "pg"
    shutil.rmtree(parent, ignore_errors=True)


def _write_docs(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, text in DOCS.items():
        (folder / name).write_text(text + "\n")
    return folder


# ============================================================================ 6: SIGTERM under serve
@pytest.mark.slow
def test_sigterm_stops_tokrag_serve_and_its_embedded_server(tmp_path, data_folder):
    """uvicorn catches SIGTERM, shuts down, then raises it again under the handler it found:
    that must end the process through ``atexit``, as Ctrl-C does, so pgserver stops the
    server and removes this process from its handle file (slow: a second process loads the
    model)."""

    from tokrag_integrations.postgres import ingest
    from tokrag_integrations.postgres.embedded import HANDLE_FILE, start_embedded

    folder = data_folder
    _, pg = start_embedded(folder)
    ingest([_write_docs(tmp_path / "docs")], data_dir=folder, table="probe", progress=False)
    pg.cleanup()  # this process no longer uses it: the server's only user is `tokrag serve`
    assert not (folder / "postmaster.pid").exists()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port),
             "--store", "postgres", "--data-dir", str(folder), "--table", "probe"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_until_healthy(proc, port, log_path)
        assert json.loads((folder / HANDLE_FILE).read_text()) == [proc.pid]
    except BaseException:
        proc.kill()
        raise
    assert_sigterm_stops_postmaster(proc, folder, log_path)
    assert json.loads((folder / HANDLE_FILE).read_text()) == []


# ============================================================================ a store and its server
@pytest.fixture(scope="module")
def store(lm, module_pg_dsn, tmp_path_factory):
    """The run's embedded server (this module's own database) holding DOCS in table
    ``probe`` (with its full-text column), its knowledge base, and ``tokrag serve --store
    postgres`` over it (in this process). ``folder``: the server's socket folder, which no
    client-facing message may name."""
    from _helpers import LiveServer

    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.postgres.dsn import dsn_params
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    dsn = module_pg_dsn
    folder = Path(dsn_params(dsn)["host"])
    docs = _write_docs(tmp_path_factory.mktemp("store") / "docs")
    ingest([docs], dsn=dsn, table="probe", progress=False)
    kb = PostgresKnowledgeBase(dsn, "probe")
    config = ServeConfig(store="postgres", dsn=dsn, table="probe", top_k=2, max_new_tokens=2)
    live = LiveServer(create_app(ChatService(lm, config, kb)))
    yield SimpleNamespace(kb=kb, live=live, dsn=dsn, folder=folder, docs=docs)
    live.stop()
    kb.close()


def _post(store, body: str):
    """A chat request whose JSON body is written by hand (a lone surrogate, a NUL escape, a
    number no JSON library writes), as a client may send it."""
    import httpx

    return httpx.post(f"{store.live.url}/v1/chat/completions", content=body.encode(),
                      headers={"Content-Type": "application/json"}, timeout=120)


def _chat(question: str = "How many days of annual leave?", filters: str | None = None) -> str:
    tokrag = "" if filters is None else f', "tokrag": {{"filters": {filters}}}'
    return ('{"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": '
            f'"{question}"}}]{tokrag}}}')


def _refused(store, response, param: str, name: str) -> str:
    """The 400's message, checked to name the field (the server's own boundary check may name
    it more closely: ``tokrag.filters.chunk.$gt``) and nothing of the server."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param or error["param"].startswith((param + ".", param + "[")), error
    assert name in error["message"]
    for secret in (str(store.folder), str(store.docs), "SELECT", "Traceback", "psycopg"):
        assert secret not in error["message"]
    return error["message"]


# ============================================================================ 7: NUL in search input
@pytest.mark.parametrize("search", ["vector", "text", "hybrid"])
def test_nul_in_the_question_is_a_value_error_naming_it(store, search):
    from tokrag_integrations.postgres import SearchInputError

    with pytest.raises(SearchInputError, match="^The query holds a NUL character") as info:
        store.kb.retrieve("annual\x00leave", search=search)
    assert info.value.field == "query"
    assert str(store.folder) not in str(info.value)


@pytest.mark.parametrize(
    "filters",
    [
        {"file_name": "a\x00b"},
        {"file_name": ["leave.md", "a\x00b"]},
        {"file_name": {"$ne": "a\x00b"}},
        {"file_name": {"$contains": "\x00"}},
        ["file_name=a\x00b"],
    ],
    ids=["eq", "in", "ne", "contains", "cli"],
)
def test_nul_in_a_filter_value_is_a_value_error_naming_the_key(store, filters):
    from tokrag_integrations.postgres import SearchInputError

    with pytest.raises(SearchInputError, match=r"^Filter 'file_name' \$\w+: the value holds a NUL"):
        store.kb.retrieve("annual leave", filters=filters)
    # the answer for the same filter without the NUL is unchanged by the check
    assert [c.source for c in store.kb.retrieve("annual leave", filters={"file_name": "leave.md"})]


def test_nul_over_http_is_a_400_naming_the_field(store):
    message = _refused(store, _post(store, _chat("annual\\u0000leave")), "messages", "query")
    assert "NUL" in message
    _refused(store, _post(store, _chat(filters='{"file_name": "a\\u0000b"}')),
             "tokrag.filters", "'file_name'")


def test_a_database_failure_is_a_503_without_server_paths(store, lm):
    """The reason (which names the socket folder) goes to the server's log only."""
    import psycopg
    from _helpers import LiveServer

    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    ingest([store.docs], dsn=store.dsn, table="dropped", progress=False)
    kb = PostgresKnowledgeBase(store.dsn, "dropped")
    with psycopg.connect(store.dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE data_dropped")
    config = ServeConfig(store="postgres", dsn=store.dsn, table="dropped", max_new_tokens=2)
    live = LiveServer(create_app(ChatService(lm, config, kb)))
    try:
        response = _post(SimpleNamespace(live=live), _chat())
    finally:
        live.stop()
        kb.close()
    assert response.status_code == 503, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("retrieval failed")
    assert str(store.folder) not in message and "data_dropped" not in message


def test_a_document_holding_nul_is_refused_with_its_reason(store, tmp_path):
    """Ingest's side: a text file holding NUL bytes is reported as binary and not stored (a
    PDF's or HTML's extracted text has its NUL characters dropped instead)."""
    from tokrag_integrations.postgres import ingest

    docs = tmp_path / "nul"
    docs.mkdir()
    (docs / "n.txt").write_bytes(b"Alpha beta\x00gamma delta.\n")
    summary = ingest([docs], dsn=store.dsn, table="probe_nul", progress=False)
    [report] = [r for r in summary.files if Path(r.path).name == "n.txt"]
    assert report.status == "failed" and "NUL" in report.reason


# ============================================================================ 14: numbers in filters
@pytest.mark.parametrize(
    "value",
    [10**400, -(10**400), 2**63, -(2**63) - 1, float("nan"), float("inf"), float("-inf")],
    ids=["huge", "-huge", "bigint+1", "bigint-1", "nan", "inf", "-inf"],
)
@pytest.mark.parametrize("op", ["$gt", "$eq", "$in"])
def test_a_filter_number_out_of_range_is_a_value_error_naming_the_key(store, value, op):
    from tokrag_integrations.postgres import SearchInputError

    spec = {op: [3, value] if op == "$in" else value}
    with pytest.raises(SearchInputError, match=rf"^Filter 'chunk' \{op}: ") as info:
        store.kb.retrieve("annual leave", filters={"chunk": spec})
    assert info.value.field == "filters.chunk"


def test_the_bigint_bounds_themselves_are_accepted(store):
    for bound in (2**63 - 1, -(2**63)):
        assert store.kb.retrieve("annual leave", filters={"chunk": {"$lt": bound}}) is not None
    assert len(store.kb.retrieve("annual leave", filters={"chunk": {"$lt": 2**63 - 1}})) == 2


@pytest.mark.parametrize("number", ["1" + "0" * 400, "1e400", "NaN", "-Infinity"])
def test_a_filter_number_out_of_range_over_http_is_a_400(store, number):
    _refused(store, _post(store, _chat(filters=f'{{"chunk": {{"$gt": {number}}}}}')),
             "tokrag.filters", "chunk")


# ============================================================================ 19: lone surrogates
@pytest.mark.parametrize("search", ["vector", "text", "hybrid"])
def test_a_lone_surrogate_in_the_question_is_a_value_error_naming_it(store, search):
    from tokrag_integrations.postgres import SearchInputError

    with pytest.raises(SearchInputError, match="^The query holds a lone surrogate") as info:
        store.kb.retrieve("annual \ud800 leave", search=search)
    assert info.value.field == "query"


@pytest.mark.parametrize(
    "filters",
    [{"file_name": "a\udfffb"}, {"file_name": {"$nin": ["leave.md", "\ud83d"]}},
     ["file_name~=\udc80"]],
    ids=["eq", "nin", "cli"],
)
def test_a_lone_surrogate_in_a_filter_value_is_a_value_error_naming_the_key(store, filters):
    from tokrag_integrations.postgres import SearchInputError

    with pytest.raises(SearchInputError, match=r"^Filter 'file_name' \$\w+: the value holds a lone"):
        store.kb.retrieve("annual leave", filters=filters)


def test_a_lone_surrogate_over_http_is_a_400_naming_the_field(store):
    # the server's boundary check (check_json_values) refuses these before the store's own
    _refused(store, _post(store, _chat("annual \\ud800 leave")), "messages", "messages")
    _refused(store, _post(store, _chat(filters='{"file_name": "a\\udfffb"}')),
             "tokrag.filters", "file_name")
    # a surrogate pair is one character, not a lone surrogate: answered
    assert _post(store, _chat("annual leave \\ud83d\\ude00")).status_code == 200


# ============================================================================ 21: sources
def _sources(live) -> list[dict]:
    response = _post(SimpleNamespace(live=live), _chat())
    assert response.status_code == 200, response.text
    return [s["metadata"] for s in response.json()["tokrag"]["sources"]]


def test_sources_are_the_stored_absolute_paths_by_default(store):
    shown = _sources(store.live)
    assert {m["source"] for m in shown} == {str((store.docs / n).resolve()) for n in DOCS}


def test_sources_relative_to_the_ingested_folder(store, lm):
    from _helpers import LiveServer

    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    config = ServeConfig(store="postgres", dsn=store.dsn, table="probe", top_k=2,
                         max_new_tokens=2, sources_relative_to=str(store.docs))
    live = LiveServer(create_app(ChatService(lm, config, store.kb)))
    try:
        shown = _sources(live)
    finally:
        live.stop()
    assert {m["source"] for m in shown} == set(DOCS)
    assert all(str(store.docs) not in json.dumps(m) for m in shown)


def test_sources_relative_to_needs_the_store(capsys):
    from tokrag_integrations.cli import main

    assert main(["serve", "--sources-relative-to", "/srv/docs"]) == 2
    assert "--sources-relative-to applies to --store postgres" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["leave\x00.md", "leave\ud800.md"], ids=["nul", "surrogate"])
def test_count_of_a_source_no_path_can_hold_names_it(store, source):
    from tokrag_integrations.postgres import SearchInputError

    with pytest.raises(SearchInputError, match="^The source holds a") as info:
        store.kb.count(source=store.docs / source)
    assert info.value.field == "source"
    assert store.kb.count(source=store.docs / "leave.md") == 1
