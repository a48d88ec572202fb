"""Issue 18, database side: secrets, bad files, deleted files, races, database errors, pgserver.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_hostile_db.py``."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from urllib.parse import quote

import pytest

from tokrag_integrations.postgres.connection import ResolvedDatabase
from tokrag_integrations.postgres.dsn import (
    PostgresConnectionError,
    dsn_params,
    mask_dsn,
    sqlalchemy_url,
)

PASSWORDS = [
    "ab/cd#Secret",
    "what?ever",
    "p@ss@word",
    "co:lon:s",
    "50%off",
    "with space",
    "пароль-€-秘密",
    "all/?#@:% ünï",
]


def _forms(password: str) -> list[str]:
    """The same credentials as a raw URL, a percent-encoded URL and libpq key=value."""
    from psycopg.conninfo import make_conninfo

    return [
        f"postgresql://rag:{password}@db.internal:5432/rag",
        f"postgresql://rag:{quote(password, safe='')}@db.internal:5432/rag",
        make_conninfo(host="db.internal", port="5432", user="rag", password=password, dbname="rag"),
    ]


def _leaks(password: str, text: str) -> bool:
    return any(form in text for form in {password, quote(password, safe=""), quote(password)})


# ============================================================================ 2: credentials
@pytest.mark.parametrize("password", PASSWORDS)
def test_mask_dsn_parses_every_password(password):
    url_raw, url_quoted, keyvalue = _forms(password)
    for dsn in (url_raw, url_quoted):
        assert mask_dsn(dsn) == "postgresql://rag:***@db.internal:5432/rag"
    assert mask_dsn(keyvalue) == "host=db.internal port=5432 user=rag password=*** dbname=rag"
    for dsn in (url_raw, url_quoted, keyvalue):
        # libpq reads the same password, and SQLAlchemy gets exactly that password
        assert dsn_params(dsn)["password"] == password
        from sqlalchemy.engine import make_url

        assert make_url(sqlalchemy_url(dsn)).password == password
        assert not _leaks(password, repr(ResolvedDatabase(dsn=dsn, origin="argument")))
        assert not _leaks(password, sqlalchemy_url(dsn, hide_password=True))


def test_unparseable_dsn_is_not_shown():
    assert "secret" not in mask_dsn("host='unterminated password=secret")
    with pytest.raises(PostgresConnectionError) as info:
        dsn_params("host='unterminated password=secret")
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("password", ["ab/cd#Secret", "p@ss@word", "what?ever", "all/?#@:% ünï"])
def test_connection_errors_hide_password(password, caplog):
    from tokrag_integrations.postgres import PostgresKnowledgeBase

    caplog.set_level(logging.DEBUG)
    for dsn in (
        f"postgresql://alice:{password}@127.0.0.1:1/rag",
        f"host=127.0.0.1 port=1 user=alice password='{password}' dbname=rag",
    ):
        with pytest.raises(PostgresConnectionError) as info:
            PostgresKnowledgeBase(dsn)
        message = str(info.value)
        assert "127.0.0.1" in message and "***" in message
        assert not _leaks(password, message)
    assert not _leaks(password, caplog.text)


def test_llamaindex_store_repr_hides_password():
    from tokrag_integrations.postgres.frameworks import (
        close_llamaindex_store,
        make_llamaindex_store,
    )
    from tokrag_integrations.postgres.layout import TableLayout

    password = "ab/cd#Secret"
    db = ResolvedDatabase(dsn=f"postgresql://rag:{password}@127.0.0.1:1/rag", origin="argument")
    store = make_llamaindex_store(db, TableLayout.for_target("t"), 384)
    try:
        assert not _leaks(password, repr(store))
        assert not _leaks(password, json.dumps(store.model_dump(), default=str))
    finally:
        close_llamaindex_store(store)


# ============================================================================ 9: ask --docs
def test_docs_skip_binary_files_with_a_message(tmp_path):
    from tokrag_integrations.retrieval import load_documents

    (tmp_path / "good.md").write_text("# Good\n\nThe Ostrander beacon blinks every 7 seconds.\n")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 50)
    (tmp_path / "noise.md").write_bytes(bytes(range(128, 256)) * 40)  # no NUL, not UTF-8
    latin1 = "The canteen serves café au lait every morning and soup at noon. " * 3
    (tmp_path / "latin1.txt").write_bytes(latin1.encode("latin-1"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = load_documents([tmp_path])
    names = sorted(Path(d.source).name for d in docs)
    assert names == ["good.md", "latin1.txt"]  # a few bad bytes: still text, with a warning
    messages = [str(w.message) for w in caught]
    assert any("image.txt" in m and "NUL" in m and "skipped" in m for m in messages)
    assert any("noise.md" in m and "not valid UTF-8" in m and "skipped" in m for m in messages)


def test_docs_progress_and_size_warning(tmp_path, capsys, monkeypatch):
    from tokrag_integrations import retrieval

    for i, word in enumerate(("Alder", "Birch", "Cedar")):
        (tmp_path / f"d{i}.md").write_text(f"# Doc {i}\n\nThe {word} pump is in hall {i}.\n")
    retriever = retrieval.build_retriever(tmp_path, kind="bm25", progress=True)
    assert retriever.retrieve("Where is the Cedar pump?", top_k=1)[0].chunk.source.endswith("d2.md")
    err = capsys.readouterr().err
    assert "Indexing 3 chunks from 3 document(s)" in err
    monkeypatch.setattr(retrieval, "LARGE_INPUT_BYTES", 64)
    with pytest.warns(ResourceWarning, match="tokrag ingest"):
        retrieval.build_retriever(tmp_path, kind="bm25")
