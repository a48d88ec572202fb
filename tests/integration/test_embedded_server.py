"""The embedded Postgres as an operator meets it: who can reach it, and how it fails (issue 29).

Everything runs against real PostgreSQL 16 + pgvector servers started by ``pgserver``: one
shared by the module, plus one per case that needs its own data folder (a long path). The
other-local-user case runs its attacker as ``nobody`` and needs root for that; elsewhere it is
skipped with the reason.

Cases that need no model, database or server are in ``tests/unit/test_embedded_server.py``."""

from __future__ import annotations

import os
import stat
import subprocess
import time
import warnings
from pathlib import Path

import pytest
from _helpers import assert_sigterm_stops_postmaster, require

pytestmark = pytest.mark.postgres

SOCKET = ".s.PGSQL.5432"


def _start(folder: Path) -> tuple[str, object]:
    require("pgserver")
    from tokrag_integrations.postgres.embedded import start_embedded

    return start_embedded(folder)


def _stop(folder: Path, server: object) -> None:
    from tokrag_integrations.postgres import embedded as pg

    server.cleanup()
    with pg._SERVERS_LOCK:
        pg._SERVERS.pop(folder.resolve(), None)


@pytest.fixture(scope="module")
def pg_dsn(tmp_path_factory):
    """An embedded server for this module, in a temporary folder."""
    folder = tmp_path_factory.mktemp("pgserver_embedded") / "pg"
    dsn, server = _start(folder)
    yield dsn
    _stop(folder, server)


@pytest.fixture(scope="module")
def long_path_dsn(tmp_path_factory):
    """An embedded server whose data folder path is too long for a Unix socket in it."""
    base = tmp_path_factory.mktemp("pgserver_long")
    folder = base / ("d" * max(1, 104 - len(str(base)))) / "pg"
    assert len(os.fsencode(str(folder / SOCKET))) > 107
    dsn, server = _start(folder)
    yield dsn
    _stop(folder, server)


def _socket_folder(dsn: str) -> Path:
    from tokrag_integrations.postgres.dsn import dsn_params

    return Path(dsn_params(dsn)["host"])


# ============================================================================ 2: private socket
@pytest.mark.parametrize("which", ["pg_dsn", "long_path_dsn"])
def test_embedded_socket_is_private_to_the_server_user(request, which):
    from tokrag_integrations.postgres.connection import check_connection

    dsn = request.getfixturevalue(which)
    folder = _socket_folder(dsn)
    if which == "long_path_dsn":
        assert not str(folder).startswith(str(Path("/tmp/runtime-")))  # not pgserver's fallback
    st = folder.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077 == 0, stat.filemode(st.st_mode)
    sock = (folder / SOCKET).lstat()
    assert stat.S_ISSOCK(sock.st_mode) and sock.st_mode & 0o077 == 0, stat.filemode(sock.st_mode)
    assert sock.st_uid == st.st_uid  # the server's own user owns both
    assert check_connection(dsn)  # and this process (that user, or root) still connects


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="runs the attacker as the user 'nobody', which needs root",
)
@pytest.mark.parametrize("which", ["pg_dsn", "long_path_dsn"])
def test_other_local_user_cannot_reach_embedded_server(request, which):
    from pgserver._commands import POSTGRES_BIN_PATH

    dsn = request.getfixturevalue(which)
    as_nobody = {"user": "nobody", "group": 65534, "extra_groups": [], "cwd": "/"}
    attack = subprocess.run(
        [str(POSTGRES_BIN_PATH / "psql"), dsn, "-c", "COPY (SELECT 1) TO PROGRAM 'id'"],
        capture_output=True, text=True, timeout=60, **as_nobody,
    )  # fmt: skip
    assert attack.returncode != 0, attack.stdout
    assert "Permission denied" in attack.stderr
    plant = subprocess.run(
        ["touch", str(_socket_folder(dsn) / "planted")], capture_output=True, **as_nobody
    )
    assert plant.returncode != 0  # nor replace the socket with one of its own


def test_running_server_with_a_reachable_socket_is_refused(tmp_path_factory):
    """A server started the old way (pgserver's world-writable fallback folder) is not used."""
    import sys

    from tokrag_integrations.postgres.dsn import PostgresSetupError

    require("pgserver")
    base = tmp_path_factory.mktemp("pgserver_old")
    folder = (base / ("o" * max(1, 104 - len(str(base)))) / "pg").resolve()
    folder.parent.mkdir()
    old_way = f"import pgserver; pgserver.get_server({str(folder)!r}, cleanup_mode=None)"
    subprocess.run([sys.executable, "-c", old_way], check=True, capture_output=True, timeout=120)
    try:
        with pytest.raises(PostgresSetupError, match="other local users can reach") as info:
            _start(folder)
        assert "pg_ctl -D" in str(info.value) and "\n" not in str(info.value)
    finally:
        from pgserver._commands import pg_ctl
        from pgserver.postgres_server import PostgresServer

        PostgresServer._instances.pop(folder, None)
        pg_ctl(["-w", "stop"], pgdata=folder, user="pgserver" if os.geteuid() == 0 else None)


# ============================================================================ 11: odd data folders
def test_data_folder_with_a_space_works_quietly(tmp_path_factory, capfd):
    from tokrag_integrations.postgres.connection import check_connection

    folder = tmp_path_factory.mktemp("pgserver space") / "my data" / "pg"
    dsn, server = _start(folder)
    try:
        assert check_connection(dsn)
        assert _socket_folder(dsn) == folder.resolve()
    finally:
        _stop(folder, server)
    out = capfd.readouterr()
    assert out.out == "" and out.err == ""


# ============================================================================ 7: reserved words
def _tables(dsn: str, *names: str) -> list[str]:
    from tokrag_integrations.postgres.connection import connect

    with connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class WHERE relname = ANY(%s)", (list(names),)
        ).fetchall()
    return sorted(r[0] for r in rows)


def test_every_reserved_word_of_the_server_is_refused_as_langchain_table(pg_dsn):
    from tokrag_integrations.postgres.connection import connect
    from tokrag_integrations.postgres.layout import TableLayout

    with connect(pg_dsn, autocommit=True) as conn:
        words = [r[0] for r in conn.execute(
            "SELECT word FROM pg_get_keywords() WHERE catcode IN ('R', 'T')"
        ).fetchall()]  # fmt: skip
    assert "user" in words
    for word in words:
        with pytest.raises(ValueError, match="reserved word in PostgreSQL"):
            TableLayout.for_target(word.upper() if word == "user" else word, "langchain")
        assert TableLayout.for_target(word, "llamaindex").table == f"data_{word}"  # prefixed


def test_reserved_word_langchain_table_is_refused_and_leaves_no_table(pg_dsn, tmp_path, capsys):
    from tokrag_integrations.cli import main

    (tmp_path / "a.md").write_text("# A\n\nThe Ossian pump moves 40 litres a minute.\n")
    argv = ["ingest", str(tmp_path), "--dsn", pg_dsn, "--table", "user", "--target", "langchain"]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokrag: error: Invalid table name 'user' for the langchain target")
    assert err.count("\n") == 1 and "data_user" in err
    assert _tables(pg_dsn, "user", "data_user") == []


def test_langchain_table_without_its_indexes_is_dropped(pg_dsn):
    """Whatever makes the index creation fail, the just-created table does not stay behind."""
    from tokrag_integrations.postgres.connection import ResolvedDatabase, pooled
    from tokrag_integrations.postgres.dsn import PostgresQueryError, database_errors
    from tokrag_integrations.postgres.layout import TableLayout, _create_table

    layout = TableLayout.for_target("wide", "langchain")
    db = ResolvedDatabase(dsn=pg_dsn, origin="argument")
    with (
        pytest.raises(PostgresQueryError, match="2000 dimensions"),
        database_errors(pg_dsn, "create"),
    ):
        with pooled(pg_dsn) as conn:  # HNSW indexes at most 2000 dimensions: the index fails
            _create_table(db, conn, layout, 2001, "english")
    assert _tables(pg_dsn, "wide") == []


# ============================================================================ 9: read-only role
def test_read_only_role_creating_a_table_is_one_sentence(pg_dsn, tmp_path, caplog):
    import logging

    from psycopg.conninfo import make_conninfo

    from tokrag_integrations.postgres import ingest
    from tokrag_integrations.postgres.connection import connect
    from tokrag_integrations.postgres.dsn import PostgresQueryError, dsn_params

    with connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS tokrag_reader")
        conn.execute("CREATE ROLE tokrag_reader LOGIN")  # no CREATE on schema public (PG 15+)
    reader = make_conninfo(**{**dsn_params(pg_dsn), "user": "tokrag_reader"})
    (tmp_path / "a.md").write_text("# A\n\nThe Brora gate closes at dusk.\n")
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PostgresQueryError, match="permission denied for schema public") as info:
        ingest([tmp_path], dsn=reader, table="reader_new", progress=False)
    assert "\n" not in str(info.value) and "GRANT CREATE" in str(info.value)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# ============================================================================ 12: SIGTERM
def test_sigterm_stops_the_embedded_server(tmp_path):
    import sys
    import textwrap

    require("pgserver")
    folder = (tmp_path / "pg").resolve()
    script = textwrap.dedent(
        f"""
        import time
        from tokrag_integrations.postgres.connection import check_connection
        from tokrag_integrations.postgres.embedded import start_embedded
        dsn, _ = start_embedded({str(folder)!r})
        check_connection(dsn)
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
    try:
        assert proc.stdout.readline().strip() == "ready", log.read_text()
    except BaseException:
        proc.kill()
        raise
    assert_sigterm_stops_postmaster(proc, folder, log)


# ============================================================================ 8: stopped outside
def _pg_ctl_stop(server: object) -> subprocess.Popen:
    """An operator's ``pg_ctl stop`` of the server under a running process (as the server's
    user when tokrag runs it as pgserver's user)."""
    from pgserver._commands import POSTGRES_BIN_PATH

    as_server = {"user": server.system_user} if server.system_user else {}
    return subprocess.Popen(
        [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(server.pgdata), "-m", "fast", "-w", "stop"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **as_server,
    )  # fmt: skip


def _stop_from_outside(server: object) -> None:
    """``pg_ctl stop -w`` ends well although this process's pool workers may start the
    server again as soon as it is down."""
    proc = _pg_ctl_stop(server)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out


def _restart_warnings(seen: list) -> list:
    return [
        w
        for w in seen
        if issubclass(w.category, RuntimeWarning)
        and "stopped from outside this process" in str(w.message)
    ]


def test_embedded_server_stopped_from_outside_is_started_again(tmp_path_factory, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    folder = tmp_path_factory.mktemp("pgserver_stopped") / "pg"
    dsn, server = _start(folder)
    try:
        (tmp_path / "a.md").write_text("# A\n\nThe Lochan bridge opens at noon.\n")
        assert ingest([tmp_path], dsn=dsn, table="stopped", progress=False).added == 1
        with PostgresKnowledgeBase(dsn, "stopped") as kb:
            assert "noon" in kb.retrieve("Lochan bridge", top_k=1)[0].text
            lc = kb.langchain_retriever(k=1)
            assert "noon" in lc.invoke("Lochan bridge")[0].page_content
            for call in (
                lambda: "noon" in kb.retrieve("Lochan bridge", top_k=1)[0].text,  # LlamaIndex
                lambda: "noon" in lc.invoke("Lochan bridge")[0].page_content,  # LangChain
                lambda: kb.count() == 1,  # psycopg
                lambda: ingest([tmp_path], dsn=dsn, table="stopped", progress=False).unchanged == 1,
            ):
                # The pool's own threads may reconnect (and start it again) first, so the
                # warning may come from another thread, a moment after the call returns.
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    _stop_from_outside(server)
                    assert call()
                    deadline = time.monotonic() + 15
                    while not _restart_warnings(seen) and time.monotonic() < deadline:
                        time.sleep(0.1)
                assert _restart_warnings(seen), [str(w.message) for w in seen]
    finally:
        _stop(folder, server)


def test_a_restart_waits_for_an_outside_pg_ctl_stop_to_end(tmp_path_factory):
    """A worker that finds the server gone while ``pg_ctl stop -w`` still waits for the PID
    file to go starts it again only after ``pg_ctl`` has ended: ``pg_ctl`` reports a clean
    stop instead of waiting out its 60 s on the new server."""
    import psycopg

    from tokrag_integrations.postgres.dsn import libpq_conninfo
    from tokrag_integrations.postgres.embedded import _start_again_if_stopped

    folder = tmp_path_factory.mktemp("pgserver_pg_ctl") / "pg"
    dsn, server = _start(folder)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            proc = _pg_ctl_stop(server)
            deadline = time.monotonic() + 120
            while not _start_again_if_stopped(server):  # polled as a pool worker would
                assert time.monotonic() < deadline, "the server was never found stopped"
                time.sleep(0.005)
            out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        assert _restart_warnings(seen), [str(w.message) for w in seen]
        with psycopg.connect(libpq_conninfo(dsn)) as conn:
            assert conn.execute("select 1").fetchone() == (1,)
    finally:
        _stop(folder, server)
