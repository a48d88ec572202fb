"""Postgres + pgvector: ingestion, retrieval through LlamaIndex and LangChain, faults, hostile
input.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_postgres.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokrag_integrations.postgres.dsn import PostgresConnectionError, PostgresSetupError, mask_dsn
from tokrag_integrations.postgres.layout import validate_table_name
from tokrag_integrations.postgres.search import (
    to_conditions,
    validate_filter_key,
)

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


# ============================================================================ unit (no server)
def test_mask_dsn_hides_password():
    assert mask_dsn("postgresql://alice:s3cret@db:5432/rag") == "postgresql://alice:***@db:5432/rag"
    assert "s3cret" not in mask_dsn("host=db user=alice password=s3cret dbname=rag")
    assert mask_dsn("postgresql://postgres:@/postgres?host=/tmp/x") == (
        "postgresql://postgres:***@/postgres?host=/tmp/x"
    )


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_table_names_rejected(name):
    with pytest.raises(ValueError, match="Invalid table name"):
        validate_table_name(name)


def test_table_name_lowercased():
    assert validate_table_name("Handbook_2024") == "handbook_2024"


@pytest.mark.parametrize("key", ["file'name", "a;b", "ключ", "a b", "", "x->>'y'", "$and"])
def test_hostile_filter_keys_rejected(key):
    with pytest.raises(ValueError, match="Invalid filter key"):
        validate_filter_key(key)
    with pytest.raises(ValueError):
        to_conditions({key: "v"})


def test_root_refuses_data_dir_in_root_home(monkeypatch):
    from tokrag_integrations.postgres import embedded

    monkeypatch.setattr(embedded, "_is_root", lambda: True)  # where default_data_dir reads it
    monkeypatch.delenv("TOKRAG_DATA_DIR", raising=False)
    assert embedded.default_data_dir() == Path("/var/lib/tokrag/pg")
    with pytest.raises(PostgresSetupError, match="world-readable"):
        embedded.start_embedded("/root/.local/share/tokrag/pg")
    monkeypatch.setenv("TOKRAG_DATA_DIR", "/srv/tokrag")
    assert embedded.default_data_dir() == Path("/srv/tokrag/pg")


def test_unreachable_dsn_fails_fast_without_password(monkeypatch):
    """Fast: one connection attempt, bounded by the connect timeout, and no retry."""
    import psycopg

    from tokrag_integrations.postgres import PostgresKnowledgeBase, ingest

    attempts = []
    real_connect = psycopg.connect

    def counted(conninfo, **kwargs):
        attempts.append(kwargs.get("connect_timeout"))
        return real_connect(conninfo, **kwargs)

    monkeypatch.setattr(psycopg, "connect", counted)
    monkeypatch.setenv("TOKRAG_PG_CONNECT_TIMEOUT", "3")
    dsn = "postgresql://alice:S3cr3t-pw%21@127.0.0.1:1/rag"
    with pytest.raises(PostgresConnectionError) as info:
        PostgresKnowledgeBase(dsn)
    assert attempts == [3]
    message = str(info.value)
    assert "S3cr3t" not in message and "127.0.0.1" in message and "alice:***@" in message
    with pytest.raises(PostgresConnectionError) as info:
        ingest([Path(__file__)], dsn=dsn, progress=False)
    assert "S3cr3t" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_cli_unreachable_dsn_exit_status(capsys, tmp_path):
    import argparse

    from tokrag_integrations.cli.pg import EXIT_DATABASE, add_ingest_parser

    (tmp_path / "a.md").write_text("# A\n\nhello\n")
    parser = argparse.ArgumentParser()
    add_ingest_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "ingest",
            str(tmp_path),
            "--dsn",
            "postgresql://bob:hunter2@127.0.0.1:1/x",
            "--no-progress",
        ]
    )
    assert args.func(args) == EXIT_DATABASE
    err = capsys.readouterr().err
    assert "Cannot connect" in err and "hunter2" not in err


def test_bad_scheme_rejected():
    from tokrag_integrations.postgres.dsn import sqlalchemy_url

    with pytest.raises(PostgresConnectionError, match="Not a Postgres"):
        sqlalchemy_url("mysql://u:topsecret@h/db")
    with pytest.raises(PostgresConnectionError) as info:
        sqlalchemy_url("mysql://u:topsecret@h/db")
    assert "topsecret" not in str(info.value)
