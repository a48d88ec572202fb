"""Every script in examples/ run end to end, as a user would: ``python examples/NAME.py``.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_examples.py``."""

from __future__ import annotations

from pathlib import Path

from tokrag_integrations.retrieval import get_sample_questions

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

# example -> the question it asks by default (its fact comes from get_sample_questions()).
EXAMPLES = {
    "langchain_quickstart.py": "What is the code name of the Kestrel-7 programme?",
    "llamaindex_quickstart.py": "What is the code name of the Kestrel-7 programme?",
    "router_langchain.py": "Who founded Quillfeather Aerospace?",
    "router_llamaindex.py": "Who founded Quillfeather Aerospace?",
    "postgres_langchain.py": "What is the guest Wi-Fi network at the Dundee office called?",
    "postgres_llamaindex.py": "How many approvals does a change to flight software need?",
}


def test_every_example_is_listed():
    """A new example gets a row in EXAMPLES (and so an end-to-end run)."""
    assert sorted(p.name for p in EXAMPLES_DIR.glob("*.py")) == sorted(EXAMPLES)


def test_example_questions_have_sample_answers():
    known = {q["question"] for q in get_sample_questions()}
    assert set(EXAMPLES.values()) <= known
