"""Every script in examples/ run end to end, as a user would: ``python examples/NAME.py``.

Each example runs in a fresh process on the packaged default model, from a temporary working
folder (so the files it writes stay out of the repository), and must exit 0, print its
answer once (one ``A:`` line) with the fact from the sample documents that answers its
default question, and print no weight-loading progress bars or runtime-dir warnings. The
Postgres examples use the embedded server from ``pgserver`` in a temporary data folder
(``$TOKRAG_DATA_DIR``), shared by both, so the user's own database is never touched and the
second one finds the handbook already ingested.

``langchain_quickstart`` runs in ``make test``; the others are marked slow (about 3 minutes
on 2 CPU cores together) and run in ``make test-all`` or with ``pytest -m slow
tests/integration/test_examples.py``.

Cases that need no model, database or server are in ``tests/unit/test_examples.py``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import require

from tokrag_integrations.retrieval import get_sample_questions

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 900  # one example; about 20-60 s each on an idle 2-core machine

# example -> the question it asks by default (its fact comes from get_sample_questions()).
EXAMPLES = {
    "langchain_quickstart.py": "What is the code name of the Kestrel-7 programme?",
    "llamaindex_quickstart.py": "What is the code name of the Kestrel-7 programme?",
    "router_langchain.py": "Who founded Quillfeather Aerospace?",
    "router_llamaindex.py": "Who founded Quillfeather Aerospace?",
    "postgres_langchain.py": "What is the guest Wi-Fi network at the Dundee office called?",
    "postgres_llamaindex.py": "How many approvals does a change to flight software need?",
}
# Output that must never reach the user: transformers' weight-loading bars, pgserver's
# platformdirs warning.
NOISE = ("Loading weights", "RuntimeDirWarning", "XDG_RUNTIME_DIR")


def _facts(question: str) -> list[str]:
    (item,) = [q for q in get_sample_questions() if q["question"] == question]
    return [item["answer"], *item["aliases"]]


def _contains_fact(answer: str, facts: list[str]) -> bool:
    """Whether ``answer`` states one of ``facts`` (case-insensitive, whole words: '3' in
    'is 3.' but not in 'Kestrel-3')."""
    return any(
        re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", answer, flags=re.IGNORECASE) for f in facts
    )


@pytest.fixture(scope="module")
def pg_data_dir(tmp_path_factory):
    """``$TOKRAG_DATA_DIR`` for the Postgres examples: the embedded server lives in
    ``<dir>/pg``; each example starts it and stops it at exit. A server left behind by an
    example that was killed (timeout) is stopped at teardown."""
    require("pgserver")
    folder = tmp_path_factory.mktemp("examples_data")
    yield folder
    if (folder / "pg" / "postmaster.pid").exists():
        from tokrag_integrations.postgres.embedded import start_embedded

        _, server = start_embedded(folder / "pg")  # drops the dead handles, then owns it
        server.cleanup()


def _env(data_dir: Path | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # a user's database, verbose loading or a runtime folder would hide what a new user sees
        if k not in ("TOKRAG_PG_DSN", "TOKRAG_VERBOSE", "XDG_RUNTIME_DIR", "TOKRAG_DATA_DIR")
    }
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if data_dir is not None:
        env["TOKRAG_DATA_DIR"] = str(data_dir)
    return env


#: The one example in the default run (the others repeat its path with another framework,
#: a router or Postgres).
DEFAULT_RUN = "langchain_quickstart.py"


def _params():
    for name in EXAMPLES:
        marks = [] if name == DEFAULT_RUN else [pytest.mark.slow]
        if name.startswith("postgres_"):
            marks.append(pytest.mark.postgres)
        yield pytest.param(name, marks=marks, id=name.removesuffix(".py"))


@pytest.mark.parametrize("name", list(_params()))
def test_example_runs_and_answers(name, request, tmp_path):
    data_dir = request.getfixturevalue("pg_data_dir") if name.startswith("postgres_") else None
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / name)],
        cwd=tmp_path,
        env=_env(data_dir),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    shown = f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 0, shown
    for noise in NOISE:
        assert noise not in proc.stdout + proc.stderr, f"{noise!r} in the output\n{shown}"

    lines = proc.stdout.splitlines()
    questions = [line[3:].strip() for line in lines if line.startswith("Q: ")]
    assert questions == [EXAMPLES[name]], shown
    answers = [line[3:].strip() for line in lines if line.startswith("A: ")]
    assert len(answers) == 1, f"expected one 'A:' line\n{shown}"
    (answer,) = answers
    assert _contains_fact(answer, _facts(EXAMPLES[name])), (
        f"the answer does not state {_facts(EXAMPLES[name])}\n{shown}"
    )
    # Printed once: no other line repeats it (the quickstarts' trace has its own 'Answer:' line).
    repeats = [line for line in lines if answer in line and not line.startswith("Answer: ")]
    assert len(repeats) == 1, f"the answer is printed {len(repeats)} times\n{shown}"

    if name == "llamaindex_quickstart.py":  # its HTML page goes to out/, not the working folder
        assert (tmp_path / "out" / "llamaindex_quickstart.html").is_file()
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
