"""Postgres search modes, filter operators, the shared pool, async retrieval, and reading the
frameworks' own tables (``PGVectorStore(hybrid_search=True)``, the older ``PGVector``).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_pg_search.py``."""

from __future__ import annotations

import re

import pytest

from tokrag_integrations.postgres.search import (
    compile_conditions,
    to_conditions,
)

HOSTILE_VALUES = ["x' OR '1'='1", "a'; DROP TABLE data_ops; --", "日本語; '\"", "%", "\\", ")) OR TRUE --"]


# ============================================================================ unit (no server)
def test_filter_forms_become_conditions():
    conds = to_conditions({"file_name": "a.md", "year": {"$gte": 2020, "$lt": 2025}, "tag": ["x", "y"]})
    assert [(c.key, c.op, c.value) for c in conds] == [
        ("file_name", "$eq", "a.md"),
        ("year", "$gte", 2020),
        ("year", "$lt", 2025),
        ("tag", "$in", ["x", "y"]),
    ]
    cli = to_conditions(["format=md", "format=html", "year>=2020", "status!=draft", "tags~=audit", "n<3.5"])
    assert [(c.key, c.op, c.value) for c in cli] == [
        ("format", "$in", ["md", "html"]),
        ("year", "$gte", 2020.0),
        ("status", "$ne", "draft"),
        ("tags", "$contains", "audit"),
        ("n", "$lt", 3.5),
    ]
    assert to_conditions(["file_name=b=c.md"])[0].value == "b=c.md"


@pytest.mark.parametrize(
    ("filters", "message"),
    [
        ({"year": {"$regex": "2."}}, "unknown operator"),
        ({"year": {"$in": []}}, "non-empty list"),
        ({"year": {"$in": "2020"}}, "non-empty list"),
        ({"year": {"$in": [2020, "2021"]}}, "mix of strings and numbers"),
        ({"year": {"$gt": True}}, "strings or numbers"),
        ({"year": {"$gt": float("nan")}}, "NaN"),
        ({"year": {"$eq": None}}, "strings or numbers"),
        ({"year": {}}, "no operators"),
        ({"a;b": {"$eq": 1}}, "Invalid filter key"),
        (["year=>3"], None),  # parses: key year, value '>3' (compared as text)
        (["a b>3"], "Invalid filter key"),
        (["nokey"], "not key=value"),
        (42, "mapping"),
    ],
)
def test_bad_filters_are_one_sentence(filters, message):
    if message is None:
        assert to_conditions(filters)[0].value == ">3"
        return
    with pytest.raises(ValueError, match=message):
        to_conditions(filters)


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_filter_values_never_reach_the_sql_text(value):
    from psycopg import sql

    params: dict = {}
    conds = to_conditions({"k": {op: ([value] if op in ("$in", "$nin") else value) for op in (
        "$eq", "$ne", "$in", "$nin", "$gt", "$gte", "$lt", "$lte", "$contains")}})
    composed = compile_conditions(conds, sql.Identifier("metadata_"), params)
    text = re.sub(r"%\(f\d+\)s", "", composed.as_string(None))  # the placeholders themselves
    assert value not in text and "'" not in text.replace("'string'", "")
    assert value in params.values() or [value] in params.values()


def test_cli_search_needs_the_postgres_store(capsys, tmp_path):
    from tokrag_integrations.cli import main

    (tmp_path / "a.md").write_text("# A\n\ntext\n")
    assert main(["ask", "q", "--docs", str(tmp_path), "--search", "hybrid"]) == 2
    assert "--search applies to --store postgres" in capsys.readouterr().err
