"""Tests for the ``tokrag`` command line: argument parsing and error paths with a fake
engine, then one real run of ``tokrag ask`` on the packaged default model.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_cli.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from _cli_fakes import run_cli

import tokrag_integrations
from tokrag_integrations import cli


def test_parse_option() -> None:
    assert cli.parse_option("pr_norm=softmax") == ("pr_norm", "softmax")
    assert cli.parse_option("alpha=0.5") == ("alpha", 0.5)
    assert cli.parse_option("layers=[1, 2]") == ("layers", [1, 2])
    assert cli.parse_option("use-gate=true") == ("use_gate", True)
    assert cli.parse_option("x=") == ("x", "")
    assert cli.parse_option("lens_norm=False") == ("lens_norm", False)
    assert cli.parse_option("plausibility_alpha=None") == ("plausibility_alpha", None)


def test_ask_defaults_parse() -> None:
    args = cli.build_parser().parse_args(["ask", "Who?"])
    assert (args.question, args.policy, args.model, args.top_k) == ("Who?", "tokrag", "default", 5)
    assert (args.retriever, args.max_new_tokens, args.explain) == ("dense", 64, False)
    assert args.docs == [] and args.passage == [] and args.option == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["ask"], "required: question"),
        (["ask", "q", "--option", "novalue"], "expected key=value"),
        (["ask", "q", "--top-k", "0"], "must be at least 1"),
        (["ask", "q", "--max-new-tokens", "many"], "expected a whole number"),
        (["ask", "q", "--retriever", "sparse"], "invalid choice"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors(argv: list[str], message: str) -> None:
    code, out, err = run_cli(argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_version() -> None:
    code, out, _ = run_cli(["--version"])
    assert code == 0 and tokrag_integrations.__version__ in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ask", "   "], "The question is empty"),
        (["ask", "q", "--docs", "/no/such/folder"], "Document path not found: /no/such/folder"),
        (["ask", "q", "--html", "/no/such/dir/t.html"], "folder /no/such/dir does not exist"),
        (["ask", "q", "--model", "missing"], "No model found at missing"),
        (["ask", "q", "--policy", "nope"], "Unknown policy 'nope'"),
    ],
)
def test_user_errors_exit_2_with_one_line(
    argv: list[str], message: str, fake_engine: dict[str, Any]
) -> None:
    code, out, err = run_cli(argv)
    assert code == 2
    lines = err.strip().splitlines()
    # The error is one line, the last; any line before it says what was under way.
    assert lines[-1].startswith("tokrag: error: ") and message in lines[-1]
    assert all(line.startswith("Loading model") for line in lines[:-1]), lines
    assert "Traceback" not in err


def test_ask_help_lists_the_policies() -> None:
    from tokrag_integrations.policies import available_policies

    code, out, _ = run_cli(["ask", "--help"])
    assert code == 0
    flat = " ".join(out.split())
    assert f"one of {', '.join(available_policies())}" in flat


def test_empty_docs_folder_is_a_user_error(tmp_path: Path, fake_engine: dict[str, Any]) -> None:
    code, _, err = run_cli(["ask", "q", "--docs", str(tmp_path)])
    assert code == 2
    assert f"No documents found in {tmp_path}" in err


def test_ask_streams_and_passes_arguments(tmp_path: Path, fake_engine: dict[str, Any]) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"The founder is Ottoline Varga \xff\xfe of Quillfeather.\n")
    html, js = tmp_path / "t.html", tmp_path / "t.json"
    code, out, err = run_cli(
        [
            "ask", "Who founded Quillfeather?", "--passage", "Extra passage.",
            "--docs", str(tmp_path), "--retriever", "bm25", "--top-k", "2",
            "--policy", "cad", "--model", "some/model", "--device", "cpu",
            "--max-new-tokens", "8", "--option", "alpha=0.25",
            "--explain", "--html", str(html), "--json", str(js),
        ]
    )  # fmt: skip
    assert code == 0, err
    assert out.splitlines()[0] == "Ottoline Varga"  # the streamed answer
    assert "Disagreement steps (1)" in out  # --explain
    assert "notes.txt" in err and "not valid UTF-8" in err  # the decode warning, once
    assert err.count("not valid UTF-8") == 1
    assert "warning: one passage was cut" in err
    assert f"{tmp_path.name}/notes.txt #0" in err  # the retrieved chunk, before the answer
    assert fake_engine["load"] == {"name_or_path": "some/model", "device": "cpu", "dtype": None}
    call = fake_engine["stream"]
    assert call["query"] == "Who founded Quillfeather?"
    assert (call["policy"], call["max_new_tokens"]) == ("cad", 8)
    assert call["policy_options"]["alpha"] == 0.25
    texts = [p.text for p in call["passages"]]
    assert texts[0] == "Extra passage."
    assert "Ottoline Varga" in texts[1]
    assert call["passages"][1].score > 0
    assert call["passages"][1].metadata["source"] == str(bad)
    assert "<!DOCTYPE html>" in html.read_text(encoding="utf-8")
    assert json.loads(js.read_text(encoding="utf-8"))["text"] == "Ottoline Varga"


def test_help_lists_the_same_document_types() -> None:
    from tokrag_integrations.retrieval import SUPPORTED_SUFFIXES, supported_types

    for argv in (["ask", "--help"], ["ingest", "--help"]):
        code, out, _ = run_cli(argv)
        assert code == 0
        assert supported_types() in " ".join(out.split())
    assert all(s in supported_types() for s in SUPPORTED_SUFFIXES)


def test_cut_answer_gets_a_one_line_hint(fake_engine: dict[str, Any]) -> None:
    code, out, err = run_cli(["ask", "Who founded Quillfeather?", "--max-new-tokens", "2"])
    assert code == 0, err
    assert out.splitlines() == ["Ottoline Varga"]  # the hint is not part of the answer
    assert "(answer cut at 2 tokens; raise --max-new-tokens)\n" in err
    code, out, err = run_cli(["ask", "Who founded Quillfeather?"])  # stopped at EOS
    assert code == 0 and "answer cut" not in err


def test_verbose_flag_turns_loading_progress_on(
    fake_engine: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokrag_integrations.models import files

    monkeypatch.setattr(files, "_show_loading_progress", False)  # restored after the test
    env = dict(os.environ)
    assert run_cli(["ask", "q"])[0] == 0 and not files._show_loading_progress
    assert run_cli(["ask", "q", "-v"])[0] == 0 and files._show_loading_progress
    assert dict(os.environ) == env, "the CLI must not set environment variables"


def test_register_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", list(cli.SUBCOMMANDS))

    @cli.register_subcommand
    def add_hello_parser(subparsers: Any) -> None:
        p = subparsers.add_parser("hello")
        p.add_argument("--fail", action="store_true")

        def run(args: Any) -> int:
            if args.fail:
                raise ValueError("hello failed")
            print("hi")
            return 0

        p.set_defaults(func=run)

    assert run_cli(["hello"])[:2] == (0, "hi\n")
    code, _, err = run_cli(["hello", "--fail"])
    assert code == 2 and err == "tokrag: error: hello failed\n"


def test_the_harness_commands_come_from_the_entry_points() -> None:
    """``tokrag eval`` and ``tokrag bench`` are tokrag_eval's, found through the
    ``tokrag.commands`` entry points of the installed package (issue 55)."""
    from tokrag_eval import commands

    found = cli.plugin_commands()
    assert commands.add_eval_parser in found and commands.add_bench_parser in found
    assert not {commands.add_eval_parser, commands.add_bench_parser} & set(cli.SUBCOMMANDS)
    code, out, _ = run_cli(["bench", "--help"])
    assert code == 0 and "--throughput" in out


def test_a_command_that_cannot_load_is_left_out_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib import metadata

    broken = metadata.EntryPoint("broken", "tokrag_no_such_package.cli:add", cli.COMMANDS_GROUP)
    real = metadata.entry_points

    def entry_points(**kw: Any) -> Any:
        return [broken] if kw.get("group") == cli.COMMANDS_GROUP else real(**kw)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    with pytest.warns(UserWarning, match=r"command 'broken' .* could not be loaded and is left out"):
        assert cli.plugin_commands() == []
    code, out, err = run_cli(["ask", "--help"])  # the other commands still run
    assert code == 0 and "usage: tokrag ask" in out
    assert "command 'broken'" in err and "left out" in err and "Traceback" not in err


# ------------------------------------------------------------------------ waits, redirected
def test_ask_passes_the_default_stop_and_its_options(fake_engine: dict[str, Any]) -> None:
    from tokrag_integrations.defaults import ANSWER_STOP, MAX_NEW_TOKENS

    assert run_cli(["ask", "q"])[0] == 0
    call = fake_engine["stream"]
    assert (call["stop"], call["max_new_tokens"]) == (list(ANSWER_STOP), MAX_NEW_TOKENS)
    assert run_cli(["ask", "q", "--no-stop"])[0] == 0
    assert fake_engine["stream"]["stop"] == []
    assert run_cli(["ask", "q", "--stop", "\\n"])[0] == 0
    assert fake_engine["stream"]["stop"] == ["\n"]


def test_redirected_ingest_prints_a_line_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokrag ingest`` with stderr redirected: a first line before the database and the
    embedder open, then one line per file as the library reports it (``on_file``). The
    library's ingest is replaced here (the real one needs Postgres: tests/integration/test_postgres.py)."""
    from tokrag_integrations.postgres import ingestion

    seen: dict[str, Any] = {}

    def fake_ingest(paths: Any, **kw: Any) -> Any:
        seen.update(kw)
        for name, status, chunks in (("a.md", "added", 3), ("b.md", "unchanged", 2)):
            if kw["on_file"] is not None:
                kw["on_file"](ingestion.FileReport(str(tmp_path / name), status, chunks=chunks))
        return ingestion.IngestSummary(table="t", target="llamaindex", database="db")

    monkeypatch.setattr(ingestion, "ingest", fake_ingest)
    code, _, err = run_cli(["ingest", str(tmp_path)])
    assert code == 0, err
    assert seen["progress"] is False  # no tqdm bar into a file
    assert err.splitlines() == [
        "ingest: opening the database and the embedder, then 1 path(s)…",
        f"ingest: added {tmp_path / 'a.md'} (3 chunks)",
        f"ingest: unchanged {tmp_path / 'b.md'} (2 chunks)",
    ]
    code, _, err = run_cli(["ingest", str(tmp_path), "--no-progress"])
    assert code == 0 and err == "" and seen["on_file"] is None
