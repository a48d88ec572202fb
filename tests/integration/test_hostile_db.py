"""Issue 18, database side: secrets, bad files, deleted files, races, database errors, pgserver.

Replays the hostile cases of issue 18 (points 2, 3, 4, 5, 7 database part, 8 and 9): passwords
with ``/ ? # @ : %``, spaces and unicode never shown; ingestion that reports and skips a bad
file instead of aborting; stale files counted and pruned; concurrent first ingests; missing
privileges, another application's table, a numeric filter on a text key, ``top_k`` > 1000 and
a bad ``TOKRAG_PG_CONNECT_TIMEOUT`` as one-sentence errors; a killed process's pgserver
handle cleaned up; ``ask --docs`` skipping binary files with progress and a size warning.
Tests marked ``postgres`` use a real PostgreSQL 16 + pgvector started by ``pgserver``.

Cases that need no model, database or server are in ``tests/unit/test_hostile_db.py``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from urllib.parse import quote

import pytest
from _helpers import CheckedThread, assert_process_ended, join_all, require

from tokrag_integrations.postgres.dsn import PostgresQueryError, PostgresSetupError, dsn_params


def _leaks(password: str, text: str) -> bool:
    return any(form in text for form in {password, quote(password, safe=""), quote(password)})


# ============================================================================ 7: timeout env
def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokrag_integrations.cli", *args],
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_connect_timeout_env_is_one_sentence(tmp_path, monkeypatch):
    from tokrag_integrations.postgres.connection import connect_timeout, resolve_dsn

    monkeypatch.setenv("TOKRAG_PG_CONNECT_TIMEOUT", "5s")
    with pytest.raises(PostgresSetupError, match="TOKRAG_PG_CONNECT_TIMEOUT='5s'"):
        resolve_dsn("postgresql://u@127.0.0.1:1/x")
    monkeypatch.setenv("TOKRAG_PG_CONNECT_TIMEOUT", "2.5")
    assert connect_timeout() == 3
    # every command used to break at import; --version must work and ingest must exit 3
    version = _cli("--version", env={"TOKRAG_PG_CONNECT_TIMEOUT": "5s"})
    assert version.returncode == 0, version.stderr
    (tmp_path / "a.md").write_text("# A\n\nhello\n")
    run = _cli(
        "ingest",
        str(tmp_path),
        "--dsn",
        "postgresql://u@127.0.0.1:1/x",  # no password: that would add the ps warning
        "--no-progress",
        env={"TOKRAG_PG_CONNECT_TIMEOUT": "5s"},
    )
    assert run.returncode == 3
    assert "Traceback" not in run.stderr and "TOKRAG_PG_CONNECT_TIMEOUT" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


# ============================================================================ fixtures
@pytest.fixture(scope="module")
def pg_dsn(module_pg_dsn):
    """This module's database on the run's shared embedded PostgreSQL + pgvector."""
    return module_pg_dsn


def _ingest_parser() -> argparse.ArgumentParser:
    from tokrag_integrations.cli.pg import add_ingest_parser

    parser = argparse.ArgumentParser()
    add_ingest_parser(parser.add_subparsers())
    return parser


def _run_ingest_cli(*argv: str) -> int:
    args = _ingest_parser().parse_args(["ingest", *argv, "--no-progress"])
    return args.func(args)


# ============================================================================ 2: real server
@pytest.mark.postgres
def test_summary_and_logs_hide_password(pg_dsn, tmp_path, caplog, capsys):
    """Trust authentication ignores the password, so a hostile one can be used for real."""
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    password = "ab/cd#Secret?x@y"
    host = dsn_params(pg_dsn)["host"]
    dsn = f"postgresql://postgres:{password}@/postgres?host={host}"
    (tmp_path / "a.md").write_text("# A\n\nThe Kessler gauge reads 14 bar.\n")
    caplog.set_level(logging.DEBUG)
    summary = ingest([tmp_path], dsn=dsn, table="secrets", progress=False)
    assert summary.added == 1
    assert not _leaks(password, summary.to_text()) and "postgres:***@" in summary.database
    with PostgresKnowledgeBase(dsn, "secrets") as kb:
        assert not _leaks(password, repr(kb) + repr(kb.db))
        assert "14 bar" in kb.retrieve("Kessler gauge", top_k=1)[0].text
        assert not _leaks(password, repr(kb.llamaindex_store()))
    assert _run_ingest_cli(str(tmp_path), "--dsn", dsn, "--table", "secrets") == 0
    out = capsys.readouterr()
    assert not _leaks(password, out.out + out.err + caplog.text)


# ============================================================================ 3: bad files
@pytest.mark.postgres
def test_ingest_reports_and_skips_every_bad_file(pg_dsn, tmp_path, monkeypatch, capsys):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a_good.md").write_text("# Good\n\nThe Ostrander beacon blinks every 7 seconds.\n")
    filler = "Filler sentence about nothing in particular. " * 250  # > 8 KB before the NUL
    (docs / "b_nul_heading.md").write_text(f"{filler}\n\n# Heading\x00 with NUL\n\nBody.\n")
    (docs / "c_binary.txt").write_bytes(bytes(range(128, 256)) * 40)
    (docs / "d_unreadable.md").write_text("# Locked\n\nSecret.\n")
    bad_name = os.path.join(os.fsencode(docs), b"e_caf\xe9.md")
    with open(bad_name, "wb") as fh:
        fh.write(b"# Cafe\n\nThe espresso machine is on floor 3.\n")
    latin1 = "The canteen serves crème brûlée on Fridays and soup on Mondays. " * 3
    (docs / "f_latin1.txt").write_bytes(latin1.encode("latin-1"))
    (docs / "z_after.md").write_text("# After\n\nThe Marwick pump moves 40 litres a minute.\n")

    from tokrag_integrations.retrieval import documents

    real_read = documents.read_file_bytes

    def read_file_bytes(path, **options):  # root can read a chmod 000 file, so refuse it here
        if Path(path).name == "d_unreadable.md":
            raise PermissionError(13, "Permission denied", str(path))
        return real_read(path, **options)

    monkeypatch.setattr(documents, "read_file_bytes", read_file_bytes)
    summary = ingest([docs], dsn=pg_dsn, table="badfiles", progress=False)
    failed = {Path(f.path).name: f.reason for f in summary.failed}
    assert set(failed) == {"b_nul_heading.md", "c_binary.txt", "d_unreadable.md", "e_caf\\xe9.md"}
    assert "NUL" in failed["b_nul_heading.md"] and "not valid UTF-8" in failed["c_binary.txt"]
    assert "Permission denied" in failed["d_unreadable.md"]
    assert "file name is not valid UTF-8" in failed["e_caf\\xe9.md"]
    assert summary.added == 3  # a_good, f_latin1 (a few bad bytes: ingested with a note), z_after
    text = summary.to_text()
    text.encode("utf-8")  # printable as it is
    assert sum(line.startswith("  skipped ") for line in text.splitlines()) == 4
    assert "note " in text and "f_latin1.txt" in text
    with PostgresKnowledgeBase(pg_dsn, "badfiles") as kb:
        assert kb.count() == 3
        assert "40 litres" in kb.retrieve("How much does the Marwick pump move?", top_k=1)[0].text
    # the CLI: exit 1 (some skipped), a summary, no traceback
    assert _run_ingest_cli(str(docs), "--dsn", pg_dsn, "--table", "badfiles") == 1
    out = capsys.readouterr()
    assert "4 failed" in out.out and "Traceback" not in out.err


# ============================================================================ 4: deleted files
@pytest.mark.postgres
@pytest.mark.parametrize("target", ["llamaindex", "langchain"])
def test_deleted_files_are_stale_then_pruned(pg_dsn, tmp_path, capsys, target):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    table = f"prune_{target}"

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "keep.md").write_text("# Keep\n\nThe Dunmore bridge opened in 1911.\n")
    (docs / "sub" / "gone.md").write_text("# Gone\n\nThe Velloy tunnel closed in 1987.\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "elsewhere.md").write_text("# Elsewhere\n\nNot under docs.\n")
    ingest([docs], dsn=pg_dsn, table=table, target=target, progress=False)
    ingest([other], dsn=pg_dsn, table=table, target=target, progress=False)
    gone = (docs / "sub" / "gone.md").resolve()
    keep = (docs / "keep.md").resolve()
    with PostgresKnowledgeBase(pg_dsn, table, target=target) as kb:
        keep_chunks = kb.count(keep)
        gone.unlink()
        (other / "elsewhere.md").unlink()  # not under the folder being ingested: untouched
        summary = ingest([docs], dsn=pg_dsn, table=table, target=target, progress=False)
        assert (summary.unchanged, summary.stale, summary.pruned) == (1, 1, 0)
        assert "1 stale" in summary.to_text() and "--prune" in summary.to_text()
        assert kb.count(gone) > 0  # kept without --prune (documented default)
        assert _run_ingest_cli(str(docs), "--dsn", pg_dsn, "--table", table, "--target", target, "--prune") == 0
        out = capsys.readouterr().out
        assert "1 pruned" in out and str(gone) in out
        assert kb.count(gone) == 0 and kb.count(keep) == keep_chunks
        assert kb.count(other / "elsewhere.md") > 0
        again = ingest([docs], dsn=pg_dsn, table=table, target=target, progress=False, prune=True)
        assert (again.unchanged, again.pruned, again.stale) == (1, 0, 0)


# ============================================================================ 5: races
@pytest.mark.postgres
def test_concurrent_first_ingest_into_new_table(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.retrieval.embedder import load_embedder

    load_embedder(None)  # loaded once, so the four threads reach the table at the same time
    for i in range(3):
        (tmp_path / f"f{i}.md").write_text(f"# File {i}\n\nThe part number of item {i} is {i}.\n")
    barrier = threading.Barrier(4)
    results = []

    def worker() -> None:
        barrier.wait()
        results.append(ingest([tmp_path], dsn=pg_dsn, table="race_new", progress=False))

    threads = [CheckedThread(target=worker, name=f"ingest {i}") for i in range(4)]
    for t in threads:
        t.start()
    join_all(threads, 240)
    assert len(results) == 4
    assert sum(s.added for s in results) == 3  # each file written once, the others unchanged
    assert sum(s.unchanged for s in results) == 9
    with PostgresKnowledgeBase(pg_dsn, "race_new") as kb:
        assert kb.count() == 3


# ============================================================================ 7: database errors
@pytest.fixture(scope="module")
def limited_dsn(pg_dsn):
    """The same server as a login role without any privilege on the public schema."""
    from psycopg.conninfo import make_conninfo

    from tokrag_integrations.postgres.connection import connect

    with connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS tokrag_limited")
        conn.execute("CREATE ROLE tokrag_limited LOGIN")
    return make_conninfo(**{**dsn_params(pg_dsn), "user": "tokrag_limited"})


@pytest.mark.postgres
def test_missing_privileges_are_one_sentence(pg_dsn, limited_dsn, tmp_path, capsys):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    (tmp_path / "a.md").write_text("# A\n\nThe Harrow lift carries 12 people.\n")
    with pytest.raises(PostgresQueryError, match="privilege") as info:
        ingest([tmp_path], dsn=limited_dsn, table="noprivs", progress=False)
    assert info.value.__cause__ is None and "\n" not in str(info.value)
    ingest([tmp_path], dsn=pg_dsn, table="privs_owner", progress=False)
    with pytest.raises(PostgresQueryError, match="permission denied"):
        PostgresKnowledgeBase(limited_dsn, "privs_owner")
    assert _run_ingest_cli(str(tmp_path), "--dsn", limited_dsn, "--table", "noprivs") == 3
    err = capsys.readouterr().err
    assert err.startswith("tokrag: error: Postgres at ") and len(err.strip().splitlines()) == 1


@pytest.mark.postgres
def test_table_of_another_application_is_refused(pg_dsn, tmp_path, capsys):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest
    from tokrag_integrations.postgres.connection import connect

    with connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS data_foreign")
        conn.execute("CREATE TABLE data_foreign (id int PRIMARY KEY, name text)")
        conn.execute("INSERT INTO data_foreign VALUES (1, 'payroll')")
    (tmp_path / "a.md").write_text("# A\n\nText.\n")
    with pytest.raises(PostgresQueryError, match="not a tokrag llamaindex table"):
        ingest([tmp_path], dsn=pg_dsn, table="foreign", progress=False)
    with pytest.raises(PostgresQueryError, match="not a tokrag"):
        PostgresKnowledgeBase(pg_dsn, "foreign")
    assert _run_ingest_cli(str(tmp_path), "--dsn", pg_dsn, "--table", "foreign") == 3
    assert "Traceback" not in capsys.readouterr().err
    with connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT * FROM data_foreign").fetchall() == [(1, "payroll")]


@pytest.mark.postgres
def test_numeric_filter_on_text_key_and_top_k_limit(pg_dsn, tmp_path):
    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    (tmp_path / "a.md").write_text("# A\n\nThe Corran valve opens at 3 bar.\n")
    ingest([tmp_path], dsn=pg_dsn, table="filters", progress=False)
    with PostgresKnowledgeBase(pg_dsn, "filters") as kb:
        with pytest.raises(ValueError, match="file_name: a number was given"):
            kb.retrieve("valve", filters={"file_name": 3})
        assert kb.retrieve("valve", filters={"chunk": 0})[0].metadata["file_name"] == "a.md"
        assert kb.retrieve("valve", filters={"file_name": "a.md"})
        with pytest.raises(ValueError, match="between 1 and 1000"):
            kb.retrieve("valve", top_k=1001)
        with pytest.raises(ValueError, match="between 1 and 1000"):
            kb.llamaindex_retriever(top_k=5000)
        assert len(kb.retrieve("valve", top_k=1000)) == 1


# ============================================================================ 8: killed process
def _postmaster_pid(folder: Path) -> int | None:
    pid_file = folder / "postmaster.pid"
    if not pid_file.exists():
        return None
    return int(pid_file.read_text().splitlines()[0])


@pytest.mark.postgres
def test_server_of_a_killed_process_is_stopped_by_the_next_one(tmp_path):
    require("pgserver")
    import psutil

    from tokrag_integrations.postgres import embedded as server
    from tokrag_integrations.postgres.connection import check_connection

    folder = (tmp_path / "pg").resolve()
    script = textwrap.dedent(
        f"""
        import os, signal
        from tokrag_integrations.postgres.connection import check_connection
        from tokrag_integrations.postgres.embedded import start_embedded
        dsn, _ = start_embedded({str(folder)!r})
        print(check_connection(dsn), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    try:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        postmaster = _postmaster_pid(folder)
        assert postmaster is not None and psutil.pid_exists(postmaster)  # outlived its user
        handles = json.loads((folder / server.HANDLE_FILE).read_text())
        assert handles and not any(psutil.pid_exists(p) for p in handles)  # the dead PID
        dsn, handle = server.start_embedded(folder)
        assert check_connection(dsn)
        assert json.loads((folder / server.HANDLE_FILE).read_text()) == [os.getpid()]
        handle.cleanup()  # what atexit does when this process ends
        assert _postmaster_pid(folder) is None  # pg_ctl stop removes it once the server is down
        assert_process_ended(postmaster)  # a zombie: it was the killed process's child
    finally:
        with server._SERVERS_LOCK:
            server._SERVERS.pop(folder, None)
        pid = _postmaster_pid(folder)
        if pid is not None and psutil.pid_exists(pid):  # never leave a server behind
            psutil.Process(pid).terminate()
