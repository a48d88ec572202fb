"""Claims of README.md checked against the code and the default model (issue 32, item 7).

Cases that need no model, database or server are in ``tests/unit/test_readme_claims.py``."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from tokrag_integrations import generate

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


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
