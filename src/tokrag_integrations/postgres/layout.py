"""The two table layouts tokrag writes and reads (LlamaIndex's ``PGVectorStore`` schema, or
``langchain-postgres``' default columns), and the check that a table of that name is one.

Shared by :mod:`.ingestion` (which writes the tables) and :mod:`.store` (which reads them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from .server import PostgresQueryError, is_reserved_word, validate_table_name

__all__ = ["Target", "TableLayout", "check_layout", "table_columns"]

Target = Literal["llamaindex", "langchain"]


@dataclass(frozen=True)
class TableLayout:
    """Physical table and column names of one of the two supported layouts."""

    target: Target
    table: str
    """Physical table name (``data_<name>`` for LlamaIndex)."""
    id_column: str
    text_column: str
    metadata_column: str
    embedding_column: str = "embedding"

    @classmethod
    def for_target(cls, name: str, target: Target = "llamaindex") -> TableLayout:
        """The layout for logical table ``name`` (validated, lower-cased)."""
        name = validate_table_name(name)
        if target == "llamaindex":
            return cls("llamaindex", f"data_{name}", "node_id", "text", "metadata_")
        if target == "langchain":
            if is_reserved_word(name):  # the physical name: SQL here and in LangChain's code
                raise ValueError(
                    f"Invalid table name {name!r} for the langchain target: it is a reserved word "
                    f"in PostgreSQL; choose another name (e.g. '{name}_docs'), or use the "
                    f"llamaindex target (stored as data_{name})."
                )
            return cls("langchain", name, "langchain_id", "content", "langchain_metadata")
        raise ValueError(f"Unknown target {target!r}; use 'llamaindex' or 'langchain'.")

    @property
    def source_expr(self) -> str:
        """SQL for a row's source path (indexed: LlamaIndex's ``ref_doc_id`` index, or ours)."""
        key = "ref_doc_id" if self.target == "llamaindex" else "source"
        return f"({self.metadata_column}->>'{key}')"


def table_columns(conn: Any, table: str) -> set[str] | None:
    """Column names of ``table`` (on the search path), or ``None`` when there is no such table."""
    row = conn.execute("SELECT to_regclass(%s)::oid", (table,)).fetchone()
    if not row or row[0] is None:
        return None
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped",
        (row[0],),
    ).fetchall()
    return {r[0] for r in rows}


def check_layout(conn: Any, layout: TableLayout, where: str) -> bool:
    """Whether ``layout``'s table exists; raises when a table of that name is not tokrag's.

    Raises:
        PostgresQueryError: A table with that name exists without the layout's columns
            (another application's table): it is neither written to nor read.
    """
    columns = table_columns(conn, layout.table)
    if columns is None:
        return False
    needed = [layout.id_column, layout.text_column, layout.metadata_column, layout.embedding_column]
    missing = [c for c in needed if c not in columns]
    if missing:
        raise PostgresQueryError(
            f"Table {layout.table} at {where} exists but is not a tokrag {layout.target} table "
            f"(it has no {', '.join(missing)} column{'s' if len(missing) > 1 else ''}); pass "
            "another --table, or rename or drop that table if it is not needed."
        )
    return True
