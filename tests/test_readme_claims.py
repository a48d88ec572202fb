"""Claims of README.md checked against the code and the default model (issue 32, item 7)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from tokrag_integrations import generate
from tokrag_integrations.defaults import (
    ANSWER_STOP,
    CHUNK_CHARS,
    CHUNK_OVERLAP,
    MAX_NEW_TOKENS,
    TOP_K,
)
from tokrag_integrations.policies.tokrag import TokRAG

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
#: The paper's rule and the literal reading as options (as in tests/test_engine.py).
PAPER_RULE = {
    "function_word_gate": False, "verdict_gate": None, "rising_gate": False, "threshold": 0.0,
    "plausibility_alpha": 0.1, "pr_skip": None,
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
        "function_word_gate", "verdict_gate", "rising_gate",
    }
    defaults = TokRAG().options()
    for column, preset in enumerate(({}, PAPER_RULE, LITERAL)):
        expected = {**defaults, **preset}
        for name, cells in table.items():
            assert cells[column] == expected[name], (name, column, cells[column], expected[name])


def test_every_environment_variable_is_in_the_readme() -> None:
    """Each ``TOKRAG_*`` name the package reads has a row in the README's table, and each row
    names a variable the package reads."""
    read = set()
    for path in (ROOT / "src").rglob("*.py"):
        read |= set(re.findall(r"[\"'](TOKRAG_[A-Z0-9_]+)[\"']", path.read_text(encoding="utf-8")))
    rows = set(re.findall(r"^\| `(TOKRAG_[A-Z0-9_]+)` \|", README, re.M))
    assert read and rows == read, (sorted(read - rows), sorted(rows - read))


def test_the_defaults_table_states_the_defaults() -> None:
    row = {m[1]: m[2] for m in re.finditer(r"^\| ([^|]+?) \| ([^|]+?) \|", README, re.M)}
    assert row["chunk size / overlap"] == f"{CHUNK_CHARS} / {CHUNK_OVERLAP} characters"
    assert row["passages per question"] == f"{TOP_K} chunks"
    assert row["answer budget"] == f"{MAX_NEW_TOKENS} new tokens"
    assert ANSWER_STOP == ("\n\n", "\n#")  # "a blank line, or a line starting with `#`"
    assert "a blank line, or a line starting with `#`" in row["where an answer stops"]


def test_the_explain_example_and_its_threshold(lm) -> None:
    """The README's ``--explain`` example: " moved" is taken from RAG with cos_ir below
    cos_llm, allowed because its margin is above the default threshold, which the table's
    title states."""
    r = generate(
        lm,
        "What is the capital of France?",
        ["The capital of France is Lyon, which moved from Paris in 2021."],
        max_new_tokens=24,
    )
    assert r.text in README
    moved = next(s for s in r.trace.steps if s.text == " moved")
    ir, llm = moved.signals["cos_ir"], moved.signals["cos_llm"]
    assert moved.source == "rag" and ir < llm
    threshold = r.trace.options["threshold"]
    assert threshold == -0.1 and ir - llm >= threshold
    out = io.StringIO()
    r.trace.render(Console(file=out, width=120))
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    title = next(line for line in lines if "Disagreement steps" in line)
    assert title in README and "threshold -0.1000" in title
    row = next(line for line in lines if "␣moved (rag)" in line)
    assert row in README
