"""Claims of README.md checked against the code and the default model (issue 32, item 7).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_readme_claims.py``."""

from __future__ import annotations

import re
from pathlib import Path

from tokrag_integrations.defaults import (
    ANSWER_STOP,
    CHUNK_CHARS,
    CHUNK_OVERLAP,
    MAX_NEW_TOKENS,
    TOP_K,
)

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_defaults_table_states_the_defaults() -> None:
    row = {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", README, re.M)}
    assert row["chunk size / overlap"] == f"{CHUNK_CHARS} / {CHUNK_OVERLAP} characters"
    assert row["passages per question"] == f"{TOP_K} chunks"
    assert row["answer budget"] == f"{MAX_NEW_TOKENS} new tokens"
    assert ANSWER_STOP == ("\n\n", "\n#")  # "a blank line, or a line starting with `#`"
    assert "a blank line, or a line starting with `#`" in row["where an answer stops"]
