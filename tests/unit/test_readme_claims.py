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
from tokrag_integrations.policies.tokrag import TokRAG

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: The paper's rule and the literal reading as options (as in tests/test_engine.py).
PAPER_RULE = {
    "function_word_gate": False, "verdict_gate": None, "rising_gate": False, "punctuation_gate": False,
    "threshold": 0.0, "plausibility_alpha": 0.1, "pr_skip": None,
}
LITERAL = {**PAPER_RULE, "min_fusion_layer": 0, "plausibility_alpha": None, "lens_norm": False}


def _cell_value(cell: str) -> object:
    """A cell of the options table as a Python value: `"rag"` -> 'rag', −0.1 -> -0.1,
    None = L/2 -> None, 0 (every layer) -> 0.0, True -> True."""
    word = cell.strip().strip("`").replace("\u2212", "-").split(" ")[0]
    if word.startswith('"'):
        return word.strip('"')
    words = {"None": None, "True": True, "False": False}
    return words[word] if word in words else float(word)


def _options_table() -> dict[str, list[object]]:
    """option -> [defaults, paper rule, literal reading] from the README's presets table."""
    rows = re.findall(r"^\| `(\w+)` \([^|]*\) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|$", README, re.M)
    return {name: [_cell_value(c) for c in cells] for name, *cells in rows}


def test_the_options_table_states_the_defaults_and_the_presets() -> None:
    table = _options_table()
    assert set(table) == {
        "threshold", "plausibility_alpha", "min_fusion_layer", "lens_norm", "pr_skip",
        "function_word_gate", "verdict_gate", "rising_gate", "punctuation_gate",
    }
    defaults = TokRAG().options()
    for column, preset in enumerate(({}, PAPER_RULE, LITERAL)):
        expected = {**defaults, **preset}
        for name, cells in table.items():
            assert cells[column] == expected[name], (name, column, cells[column], expected[name])


def test_every_environment_variable_is_in_the_readme() -> None:
    """Each ``TOKRAG_*`` name the package reads has a row in the README's table or, for the
    speed variables, in docs/speed.md's table of ``Speed`` fields (field | variable | ...),
    and each row names a variable the package reads."""
    from tokrag_integrations import (
        config,  # the one module that reads them (tests/unit/test_config.py)
    )

    read = set(re.findall(r'"(TOKRAG_[A-Z0-9_]+)"', Path(config.__file__).read_text(encoding="utf-8")))
    rows = set(re.findall(r"^\| `(TOKRAG_[A-Z0-9_]+)` \|", README, re.M))
    speed = (ROOT / "docs" / "speed.md").read_text(encoding="utf-8")
    speed_rows = set(re.findall(r"^\| `\w+` \| `(TOKRAG_[A-Z0-9_]+)` \|", speed, re.M))
    assert speed_rows and not rows & speed_rows, sorted(rows & speed_rows)
    rows |= speed_rows
    assert read and rows == read, (sorted(read - rows), sorted(rows - read))




def test_the_defaults_table_states_the_defaults() -> None:
    row = {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", README, re.M)}
    assert row["chunk size / overlap"] == f"{CHUNK_CHARS} / {CHUNK_OVERLAP} characters"
    assert row["passages per question"] == f"{TOP_K} chunks"
    assert row["answer budget"] == f"{MAX_NEW_TOKENS} new tokens"
    assert ANSWER_STOP == ("\n\n", "\n#")  # "a blank line, or a line starting with `#`"
    assert "a blank line, or a line starting with `#`" in row["where an answer stops"]
