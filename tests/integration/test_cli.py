"""Tests for the ``tokrag`` command line: argument parsing and error paths with a fake
engine, then one real run of ``tokrag ask`` on the packaged default model.

Cases that need no model, database or server are in ``tests/unit/test_cli.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli_fakes import run_cli
from _helpers import sharing_model

import tokrag_integrations
from tokrag_integrations import cli, generate
from tokrag_integrations.defaults import ANSWER_STOP
from tokrag_integrations.retrieval import get_sample_questions


# ------------------------------------------------------------------------ parsing
def test_import_is_light() -> None:
    code = (
        "import sys, tokrag_integrations.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'sentence_transformers', 'bm25s') "
        "if m in sys.modules))"
    )
    src = str(Path(cli.__file__).resolve().parents[2])  # src/ (cli is a package)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_python_dash_m_runs_the_cli() -> None:
    src = str(Path(cli.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-m", "tokrag_integrations.cli", "--version"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"tokrag {tokrag_integrations.__version__}"


def test_unknown_policy_fails_before_torch_is_imported() -> None:
    """``tokrag ask Q --policy nope --docs sample`` fails in a fraction of a second: the
    name is checked before anything imports torch (which alone takes ~2 s)."""
    code = (
        "import sys; from tokrag_integrations.cli import main; "
        "rc = main(['ask', 'Q', '--policy', 'nope', '--docs', 'sample']); "
        "print('torch' in sys.modules); sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip() == "False"
    from tokrag_integrations.policies import available_policies

    names = ", ".join(available_policies())
    assert proc.stderr.strip().splitlines() == [
        f"tokrag: error: Unknown policy 'nope'. Available policies: {names}."
    ]


def test_ask_docs_folder_reads_pdf_and_skips_binary(
    tmp_path: Path, fake_engine: dict[str, Any], make_pdf: Any
) -> None:
    make_pdf(tmp_path / "report.pdf", ["The Brannock relay was commissioned in 1987 by Ilse Marr."])
    (tmp_path / "notes.md").write_text("# Notes\n\nThe canteen opens at 8.\n", encoding="utf-8")
    (tmp_path / "dump.txt").write_bytes(b"\x00\x01\x02PK\x03\x04" * 50)
    code, out, err = run_cli(
        ["ask", "Who commissioned the Brannock relay?", "--docs", str(tmp_path), "--top-k", "1"]
    )
    assert code == 0, err
    assert "dump.txt: looks binary" in err and "skipped" in err  # said, not indexed
    assert f"{tmp_path.name}/report.pdf #0" in err  # the PDF's chunk was retrieved and listed
    (passage,) = fake_engine["stream"]["passages"]
    assert "Ilse Marr" in passage.text and passage.metadata["format"] == "pdf"


@pytest.mark.slow
def test_model_loading_is_quiet_unless_verbose(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import logging as hf_logging

    from tokrag_integrations.config import VERBOSE
    from tokrag_integrations.models import load_model

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process (`tokrag ask` turns it off)
    try:
        monkeypatch.delenv(VERBOSE, raising=False)
        load_model("default", device="cpu")
        quiet = capfd.readouterr().err
        restored = hf_logging.is_progress_bar_enabled()  # the quiet load put the switch back
        monkeypatch.setenv(VERBOSE, "1")
        load_model("default", device="cpu")
        verbose = capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()
    assert "Loading weights" not in quiet
    assert "Loading weights" in verbose
    assert restored


# ------------------------------------------------------------------------ real model
QUESTION = next(q for q in get_sample_questions() if q["source"] == "company_overview.md")


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, lm: Any) -> dict[str, Any]:
    """One real ``tokrag ask`` on the default model (the session's) over the sample docs."""
    folder = tmp_path_factory.mktemp("cli")
    html, js = folder / "trace.html", folder / "trace.json"
    with sharing_model(lm):
        code, out, err = run_cli(
            [
                "ask", QUESTION["question"], "--docs", "sample", "--top-k", "3",
                "--policy", "rag", "--max-new-tokens", "24", "--device", "cpu",
                "--explain", "--html", str(html), "--json", str(js), "--citations",
            ]
        )  # fmt: skip
    return {"code": code, "out": out, "err": err, "html": html, "json": js}


def test_real_ask_answers_from_sample_docs(real_run: dict[str, Any]) -> None:
    assert real_run["code"] == 0, real_run["err"]
    answer = real_run["out"].split("─")[0]  # the streamed answer, before the trace
    assert QUESTION["answer"] in answer
    assert "sample_docs/company_overview.md" in real_run["err"]  # retrieved chunks are listed


def test_real_ask_writes_html_and_json(real_run: dict[str, Any]) -> None:
    assert real_run["code"] == 0, real_run["err"]
    page = real_run["html"].read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and 'class="tok ' in page
    data = json.loads(real_run["json"].read_text(encoding="utf-8"))
    assert data["query"] == QUESTION["question"]
    assert QUESTION["answer"] in data["text"]
    assert len(data["passages"]) == 3
    assert "Tok-RAG trace" in real_run["out"]  # --explain rendered the trace
    assert re.search(r"Cited: .*?\[[012]\]", real_run["out"], re.S)  # spans marked
    assert "<h2>Citations</h2>" in page and data["citations"][0]["passage"] in (0, 1, 2)


def test_real_ask_tokrag_gives_the_core_answer_and_decisions(tmp_path: Path, cli_shares_model) -> None:
    """The default policy through the command line, with a policy option: the streamed
    answer, the trace's decisions and its options are those of the core API on the same
    passages (a fact the model cannot know, so the rule meets disagreements)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Zorbin Quell owns a grey cat named Pistachio.", encoding="utf-8")
    js = tmp_path / "trace.json"
    question = "What is the name of the cat owned by Zorbin Quell?"
    code, out, err = run_cli(
        [
            "ask", question, "--docs", str(docs), "--top-k", "1", "--max-new-tokens", "8",
            "--option", "threshold=0.2", "--device", "cpu", "--json", str(js),
        ]
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(js.read_text(encoding="utf-8"))
    want = generate(cli_shares_model, question, [p["text"] for p in data["passages"]],
                    policy="tokrag", policy_options={"threshold": 0.2}, max_new_tokens=8,
                    stop=list(ANSWER_STOP))
    assert data["policy"] == "tokrag" and data["options"]["threshold"] == 0.2
    assert data["text"] == want.text and out.startswith(want.text)
    assert [(s["token_id"], s["source"]) for s in data["steps"]] == [
        (s.token_id, s.source) for s in want.trace.steps
    ]
    assert any(len({c["token_id"] for c in s["candidates"].values()}) > 1 for s in data["steps"])


def test_real_ask_policy_llm_retrieves_nothing(tmp_path: Path, cli_shares_model) -> None:
    """The pure model reads no passage, so ``--docs`` is neither read nor embedded."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("Quillfeather Aerospace was founded by Ottoline Varga.", encoding="utf-8")
    js = tmp_path / "trace.json"
    code, out, err = run_cli(
        [
            "ask", "Name a colour.", "--docs", str(docs), "--policy", "no_rag",
            "--max-new-tokens", "4", "--device", "cpu", "--json", str(js),
        ]
    )  # fmt: skip
    assert code == 0, err
    assert "reads no passages: nothing is retrieved" in err
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["policy"] == "no_rag" and data["passages"] == []
    assert "a.md" not in err  # no retrieved chunk listed


def test_real_ask_docs_twice_embeds_nothing_the_second_time(tmp_path: Path, cli_shares_model) -> None:
    """``ask --docs`` keeps chunk embeddings in the cache folder: the same folder asked
    about again embeds 0 chunks (issue 32)."""
    import uuid

    docs = tmp_path / "docs"
    docs.mkdir()
    tag = uuid.uuid4().hex  # a text no earlier run has embedded
    (docs / "a.md").write_text(f"Quillfeather's badge code is {tag}.", encoding="utf-8")
    argv = ["ask", "What is the badge code?", "--docs", str(docs), "--policy", "rag",
            "--max-new-tokens", "2", "--device", "cpu"]  # fmt: skip
    code, _, err = run_cli(argv)
    assert code == 0, err
    assert "Embedding 1 chunk(s); 0 read from the cache." in err
    code, _, err = run_cli(argv)
    assert code == 0, err
    assert "Embedding 0 chunk(s); 1 read from the cache." in err


def test_real_ask_sources_prints_every_passage_in_full(cli_shares_model) -> None:
    """``--sources`` lists each passage's source and score and its whole text, wrapped to
    the console width, not cut (issue 32)."""
    code, out, err = run_cli(
        [
            "ask", QUESTION["question"], "--docs", "sample", "--top-k", "2", "--policy", "rag",
            "--max-new-tokens", "2", "--device", "cpu", "--sources", "--citations",
        ]
    )  # fmt: skip
    assert code == 0, err
    sources = out.split("Sources, by their share of the answer's attention\n", 1)[1]
    assert "[0] sample_docs/company_overview.md #0  score " in sources
    assert "[1] " in sources
    shares = [float(x) for x in re.findall(r"cited (\d+) %", sources)]  # largest first
    assert len(shares) == 2 and shares == sorted(shares, reverse=True)
    flat = " ".join(sources.split())
    assert "seed grant of £640,000 from the Tayside Space Fund" in flat  # deep in the chunk
    assert max(len(line) for line in sources.splitlines()) <= 80  # wrapped, not one long line


def test_redirected_ask_docs_prints_plain_progress_lines(
    tmp_path: Path, fake_engine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stderr is not a terminal here (a StringIO, as a file or a pipe would be): every wait
    of ``ask --docs`` (indexing, each batch of 64 embedded chunks, loading the model) is a
    line of its own, with no bar and no carriage return; asked again, nothing is embedded."""
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))  # cold embedding cache
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        paragraphs = [
            f"Relay {i}-{j} of the northern grid was commissioned in {1900 + j} by engineer "
            f"{j * 7 + i}, and its logbook lists {j * 3} inspections since then."
            for j in range(200)
        ]
        (docs / f"grid{i}.md").write_text("\n\n".join(paragraphs), encoding="utf-8")
    code, _, err = run_cli(["ask", "Who commissioned relay 2-5?", "--docs", str(docs)])
    assert code == 0, err
    assert "\r" not in err
    lines = err.splitlines()
    n = int(re.search(r"^Indexing (\d+) chunks from 3 document\(s\) \(dense\)…$", err, re.M)[1])
    assert n > 64  # at least two batches
    assert f"Embedding {n} chunk(s); 0 read from the cache." in lines
    embedded = [line for line in lines if line.startswith("Embedded ")]
    assert [int(re.fullmatch(r"Embedded (\d+)/(\d+) chunks \(\d+ s\)", e)[1]) for e in embedded] == [
        *range(64, n, 64),
        n,
    ]
    assert all(f"/{n} chunks" in e for e in embedded)
    assert "Loading model default…" in lines
    assert any(re.fullmatch(r"  done in \d+\.\d s", line) for line in lines)

    code, _, again = run_cli(["ask", "Who commissioned relay 2-5?", "--docs", str(docs)])
    assert code == 0, again
    assert f"Embedding 0 chunk(s); {n} read from the cache." in again.splitlines()
    assert "Embedded " not in again
