"""The SQL behind :meth:`PostgresKnowledgeBase.retrieve`: vector, full-text and hybrid
search with metadata filters (modes, operators and scores: docs/postgres.md), built with
:mod:`psycopg.sql`: names are :class:`~psycopg.sql.Identifier` objects, every value a bound
parameter. Inputs no query can carry are refused with a :class:`SearchInputError` first."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..retrieval.fusion import reciprocal_rank_fusion

SearchMode = Literal["vector", "text", "hybrid"]
#: Metadata filters as the public calls take them (see :func:`to_conditions`).
Filters = Mapping[str, Any] | Sequence[str] | None
#: Largest ``top_k``: pgvector's HNSW search visits at most ``hnsw.ef_search`` <= 1000 rows.
MAX_TOP_K = 1000
SEARCH_MODES: tuple[str, ...] = ("vector", "text", "hybrid")
FILTER_OPERATORS: tuple[str, ...] = (
    "$eq", "$ne", "$in", "$nin", "$gt", "$gte", "$lt", "$lte", "$contains",
)  # fmt: skip

#: PostgreSQL's ``bigint`` range: a filter integer outside it is refused.
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_TS_CONFIG_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_CLI_OPS = {"!=": "$ne", ">=": "$gte", "<=": "$lte", "~=": "$contains", "=": "$eq", ">": "$gt",
            "<": "$lt"}  # fmt: skip


class SearchInputError(ValueError):
    """A search input no query can carry, refused before any SQL runs; the message names the
    field, never the value, and :attr:`field` says which: ``"query"`` or ``"filters.<key>"``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_search(search: Any) -> str:
    """``search`` if it is one of :data:`SEARCH_MODES`, else a ``ValueError`` naming them."""
    if search not in SEARCH_MODES:
        raise ValueError(f"Unknown search {search!r}; use 'vector', 'text' or 'hybrid'.")
    return str(search)


def validate_ts_config(config: Any) -> str:
    """``config`` if it looks like a text search configuration name (``english``, ``simple``);
    whether the server has it is checked on use (:func:`ts_config_exists`)."""
    if not isinstance(config, str) or not _TS_CONFIG_RE.fullmatch(config):
        raise ValueError(
            f"Invalid text search configuration {config!r}: use the name of one of the "
            "server's configurations (SELECT cfgname FROM pg_ts_config), e.g. 'english' or "
            "'simple'."
        )
    return config


def ts_config_exists(conn: Any, config: str) -> None:
    """Raise a ``ValueError`` when the server has no text search configuration ``config``."""
    validate_ts_config(config)
    if conn.execute("SELECT 1 FROM pg_ts_config WHERE cfgname = %s", (config,)).fetchone():
        return
    names = [r[0] for r in conn.execute("SELECT cfgname FROM pg_ts_config ORDER BY 1")]
    raise ValueError(
        f"The server has no text search configuration {config!r}; use one of: {', '.join(names)}."
    )


def check_text(value: str, field: str, name: str) -> str:
    """``value`` if it holds no NUL character and no lone surrogate, else a
    :class:`SearchInputError` for ``field`` naming ``name`` ("the query") and where."""
    at = value.find("\x00")
    if at >= 0:
        raise SearchInputError(
            field,
            f"{name[0].upper()}{name[1:]} holds a NUL character (position {at}), which "
            "PostgreSQL text cannot hold; remove it.",
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SearchInputError(
            field,
            f"{name[0].upper()}{name[1:]} holds a lone surrogate (position {exc.start}), "
            "which is not Unicode text; send the text as valid UTF-8.",
        ) from None
    return value


# ============================================================================ filters
def validate_filter_key(key: str) -> str:
    """``key`` if it is a plain ASCII identifier, else a ``ValueError`` saying so."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"Invalid filter key {key!r}: use ASCII letters, digits and underscores, starting "
            "with a letter or underscore (e.g. file_name, source, chunk)."
        )
    return key


@dataclass(frozen=True)
class Condition:
    """One filter condition: ``metadata[key] <op> value``."""

    key: str
    op: str
    value: Any

    @property
    def numeric(self) -> bool:
        """Whether the value is compared as a number."""
        values = self.value if isinstance(self.value, (list, tuple)) else [self.value]
        return all(not isinstance(v, str) for v in values)


def _check_value(key: str, op: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"Filter {key!r} {op}: values must be strings or numbers, got {type(value).__name__}."
        )
    if isinstance(value, str):
        return check_text(value, f"filters.{key}", f"filter {key!r} {op}: the value")
    if isinstance(value, float) and not math.isfinite(value):
        raise SearchInputError(
            f"filters.{key}",
            f"Filter {key!r} {op}: {'NaN' if value != value else 'infinity'} is not a "
            "value to compare with; give a finite number.",
        )
    if isinstance(value, int) and not BIGINT_MIN <= value <= BIGINT_MAX:
        raise SearchInputError(
            f"filters.{key}",
            f"Filter {key!r} {op}: the number is outside PostgreSQL's bigint "
            f"range ({BIGINT_MIN}..{BIGINT_MAX}).",
        )
    return value


def _condition(key: str, op: str, value: Any) -> Condition:
    if op not in FILTER_OPERATORS:
        raise ValueError(
            f"Filter {key!r}: unknown operator {op!r}; use one of {' '.join(FILTER_OPERATORS)}."
        )
    if op in ("$in", "$nin"):
        if not isinstance(value, (list, tuple, set, frozenset)) or not value:
            raise ValueError(f"Filter {key!r} {op}: give a non-empty list of values.")
        values = [_check_value(key, op, v) for v in value]
        kinds = {isinstance(v, str) for v in values}
        if len(kinds) > 1:
            raise ValueError(
                f"Filter {key!r} {op}: mix of strings and numbers; give all values as strings "
                "or all as numbers."
            )
        return Condition(
            key, op, sorted(values, key=str) if isinstance(value, (set, frozenset)) else values
        )
    return Condition(key, op, _check_value(key, op, value))


def _any_of(key: str, values: Any) -> Condition:
    """``$eq`` for one value, ``$in`` for several."""
    if len(values) == 1:
        return _condition(key, "$eq", next(iter(values)))
    return _condition(key, "$in", values)


def _cli_value(text: str) -> str | float:
    """A number when ``text`` reads as one (for ``--filter 'year>=2020'``), else the text."""
    try:
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


def _parse_cli(args: Sequence[str]) -> list[Condition]:
    equal: dict[str, list[str]] = {}
    out: list[Condition] = []
    for arg in args:
        text = str(arg)
        # operators longest first, so ">=" is not read as ">" then "=value"
        match = re.match(r"^\s*([^=!<>~]*?)\s*(!=|>=|<=|~=|=|>|<)(.*)$", text, flags=re.DOTALL)
        if not match:
            raise ValueError(
                f"--filter {text!r} is not key=value (e.g. --filter file_name=guide.md, or "
                "year>=2020, status!=draft, tags~=audit)."
            )
        key, symbol, value = match.groups()
        key = validate_filter_key(key)
        op = _CLI_OPS[symbol]
        if op == "$eq":
            equal.setdefault(key, []).append(value)  # repeated key: any of these values
        elif op in ("$gt", "$gte", "$lt", "$lte"):
            out.append(_condition(key, op, _cli_value(value)))
        else:
            out.append(_condition(key, op, value))
    return [_any_of(k, v) for k, v in equal.items()] + out


def to_conditions(filters: Any) -> list[Condition]:
    """Filters as a list of :class:`Condition` (keys validated, values checked).

    Accepts ``None``; ``{key: value}``, ``{key: [values]}`` (any of) or
    ``{key: {"$gte": 3, "$lt": 9}}``; or ``--filter`` strings (``key=v``, ``key!=v``,
    ``key>=v``, ``key<=v``, ``key>v``, ``key<v``, ``key~=v``; a number compares as one).
    """
    if not filters:
        return []
    if isinstance(filters, str):
        return _parse_cli([filters])
    if not isinstance(filters, Mapping):
        if isinstance(filters, (list, tuple)) and all(isinstance(f, str) for f in filters):
            return _parse_cli(filters)
        raise ValueError(
            "Filters must be a mapping ({'file_name': 'a.md'}, {'year': {'$gte': 2020}}) or "
            f"key=value strings, got {type(filters).__name__}."
        )
    out: list[Condition] = []
    for key, spec in filters.items():
        validate_filter_key(key)
        if isinstance(spec, Mapping):
            if not spec:
                raise ValueError(f"Filter {key!r} has no operators.")
            for op, value in spec.items():
                out.append(_condition(key, op, value))
        elif isinstance(spec, (list, tuple, set, frozenset)):
            if not spec:
                raise ValueError(f"Filter {key!r} has no values.")
            out.append(_any_of(key, spec))
        else:
            out.append(_condition(key, "$eq", spec))
    return out


def compile_conditions(conditions: Sequence[Condition], meta: Any, params: dict[str, Any]) -> Any:
    """The SQL of ``conditions`` ANDed (``TRUE`` when none) over JSON column ``meta``; values
    go into ``params`` under fresh names (``f0``, ``f1``...)."""
    from psycopg import sql
    from psycopg.types.json import Jsonb

    parts = []
    for cond in conditions:
        n = len(params)
        key_name, value_name = f"f{n}", f"f{n + 1}"
        params[key_name] = cond.key
        key = sql.Placeholder(key_name)
        value = sql.Placeholder(value_name)
        as_text = sql.SQL("({} ->> {}::text)").format(meta, key)
        column = sql.SQL("({}::double precision)").format(as_text) if cond.numeric else as_text
        op, v = cond.op, cond.value
        if op in ("$in", "$nin"):
            params[value_name] = [float(x) for x in v] if cond.numeric else [str(x) for x in v]
            cast = sql.SQL("double precision[]" if cond.numeric else "text[]")
            test = sql.SQL("{} = ANY({}::{})").format(column, value, cast)
            parts.append(
                test if op == "$in" else sql.SQL("({} IS NULL OR NOT {})").format(as_text, test)
            )
            continue
        if op == "$contains":
            params[value_name] = Jsonb([v])
            params[f"f{n + 2}"] = str(v)
            parts.append(
                sql.SQL(
                    "(({m}::jsonb -> {k}::text) @> {v} OR (jsonb_typeof({m}::jsonb -> {k}::text) "
                    "= 'string' AND strpos({t}, {s}::text) > 0))"
                ).format(m=meta, k=key, v=value, t=as_text, s=sql.Placeholder(f"f{n + 2}"))
            )
            continue
        params[value_name] = float(v) if cond.numeric else str(v)
        typed = sql.SQL("{}::double precision" if cond.numeric else "{}::text").format(value)
        if op == "$ne":
            parts.append(sql.SQL("({} IS NULL OR {} <> {})").format(as_text, column, typed))
            continue
        symbol = {"$eq": "=", "$gt": ">", "$gte": ">=", "$lt": "<", "$lte": "<="}[op]
        collate = sql.SQL("") if cond.numeric or op == "$eq" else sql.SQL(' COLLATE "C"')
        parts.append(sql.SQL("{} {} {}{}").format(column, sql.SQL(symbol), typed, collate))
    return sql.SQL(" AND ").join(parts) if parts else sql.SQL("TRUE")


# ============================================================================ statements
def search_statement(
    layout: Any,
    search: str,
    conditions: Sequence[Condition],
    *,
    top_k: int,
    candidates: int,
    embedding: Any,
    query: str,
    ts_config: str | None,
) -> tuple[Any, dict[str, Any]]:
    """``(statement, params)`` of one search over a :class:`~.layout.TableLayout`; rows are
    ``(node_id, text, metadata, score)``, best first. Hybrid: the candidates of the two
    rankings, ``candidates`` rows each, as ``(key, node_id, text, metadata, vector rank, text
    rank)`` (a rank is ``None`` where that ranking lacks the row), for :func:`fuse_rows`; the
    text ranking votes only for chunks holding every word of the question when there are
    any, so near-identical chunks differing in one identifier are told apart."""
    from psycopg import sql

    params: dict[str, Any] = dict(
        top_k=top_k, candidates=candidates, embedding=embedding, query=query,
        ts_config=ts_config,
    )  # fmt: skip
    meta = sql.Identifier(layout.metadata_column)
    conditions_sql = compile_conditions(conditions, meta, params)
    # Every word of the question (plainto_tsquery ANDs them) and any of them (OR), written
    # out where used: a CTE read twice is materialised and hides the query from the GIN index.
    every = "plainto_tsquery(%(ts_config)s::regconfig, %(query)s)"
    fields = dict(
        table=sql.Identifier(layout.table),
        key=sql.Identifier(layout.key_column),
        node_id=sql.Identifier(layout.id_column),
        text=sql.Identifier(layout.text_column),
        meta=meta,
        emb=sql.Identifier(layout.embedding_column),
        tsv=sql.Identifier(layout.tsv_column) if layout.tsv_column else sql.SQL("NULL"),
        where=sql.SQL("{} AND {}").format(layout.where_sql, conditions_sql),
        every=sql.SQL(every),
        any=sql.SQL(f"replace({every}::text, ' & ', ' | ')::tsquery"),
    )
    if search == "vector":
        statement = (
            "SELECT {node_id}::text, {text}, {meta}, 1 - ({emb} <=> %(embedding)s) AS score "
            "FROM {table} WHERE {where} ORDER BY {emb} <=> %(embedding)s LIMIT %(top_k)s"
        )
    elif search == "text":
        statement = (
            "SELECT node_id_, text_, meta_, score FROM ("
            "  SELECT {key} AS key_, {node_id}::text AS node_id_, {text} AS text_, {meta} AS meta_,"
            "  ({tsv} @@ {every})::int + ts_rank({tsv}, {any}) / (1 + ts_rank({tsv}, {any})) AS score"
            "  FROM {table} WHERE {tsv} @@ {any} AND {where}) AS s "
            "ORDER BY score DESC, key_ LIMIT %(top_k)s"
        )
    else:
        statement = (
            "WITH v AS (SELECT id, row_number() OVER (ORDER BY d, id) AS r FROM ("
            "  SELECT {key} AS id, {emb} <=> %(embedding)s AS d FROM {table} WHERE {where}"
            "  ORDER BY {emb} <=> %(embedding)s LIMIT %(candidates)s) AS s), "
            "t_all AS (SELECT {key} AS id, ts_rank({tsv}, {any}) AS rank FROM {table} "
            "  WHERE {tsv} @@ {every} AND {where} ORDER BY rank DESC LIMIT %(candidates)s), "
            "t_any AS (SELECT {key} AS id, ts_rank({tsv}, {any}) AS rank FROM {table} "
            "  WHERE {tsv} @@ {any} AND {where} AND NOT EXISTS (SELECT 1 FROM {table} "
            "  WHERE {tsv} @@ {every} AND {where}) ORDER BY rank DESC LIMIT %(candidates)s), "
            "t AS (SELECT id, row_number() OVER (ORDER BY rank DESC, id) AS r FROM ("
            "  SELECT * FROM t_all UNION ALL SELECT * FROM t_any) AS u), "
            "f AS (SELECT coalesce(v.id, t.id) AS id, v.r AS vr, t.r AS tr "
            "  FROM v FULL OUTER JOIN t ON v.id = t.id) "
            "SELECT f.id, x.{node_id}::text, x.{text}, x.{meta}, f.vr, f.tr FROM f JOIN {table} AS x "
            "ON x.{key} = f.id"
        )
    return sql.SQL(statement).format(**fields), params


def check_top_k(top_k: Any, name: str = "top_k") -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"{name} must be a whole number, got {top_k!r}.")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(
            f"{name} must be between 1 and {MAX_TOP_K} (pgvector's HNSW search returns at "
            f"most {MAX_TOP_K} rows), got {top_k}."
        )


def fuse_rows(
    rows: Sequence[tuple[Any, ...]],
    *,
    top_k: int,
    rrf_k: float,
    vector_weight: float,
    text_weight: float,
) -> list[tuple[Any, Any, Any, float]]:
    """The ``top_k`` best of a hybrid statement's rows (``(key, node_id, text, metadata,
    vector rank, text rank)``) as ``(node_id, text, metadata, score)``, fused by
    :func:`~tokrag_integrations.retrieval.fusion.reciprocal_rank_fusion` (the folder
    retrievers' fusion; equal scores: the smaller row key first)."""
    by_key = {row[0]: row for row in rows}
    rankings = [
        [row[0] for row in sorted((r for r in rows if r[col] is not None), key=lambda r: r[col])]
        for col in (4, 5)
    ]
    fused = reciprocal_rank_fusion(rankings, (vector_weight, text_weight), rrf_k)[:top_k]
    return [(*by_key[key][1:4], score) for key, score in fused]
