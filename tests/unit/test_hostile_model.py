"""Hostile and careless use of one shared model (issue 18, points 1, 6 and 7).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_hostile_model.py``."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest

import tokrag_integrations
from tokrag_integrations import Passage
from tokrag_integrations.policies import get_policy


def test_passage_text_and_score_are_checked():
    with pytest.raises(TypeError, match="Passage text must be a string, got NoneType"):
        Passage(text=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Passage score must be a number or None, got str"):
        Passage("text", score="high")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Passage metadata must be a dict"):
        Passage("text", metadata=["source"])  # type: ignore[arg-type]


def test_bool_policy_options_are_parsed_strictly():
    for text, value in [("False", False), ("false", False), ("0", False), (0, False), ("TRUE", True), ("1", True), (True, True)]:
        assert get_policy("tokrag", lens_norm=text).lens_norm is value, text
    for bad in ["yes", "False!", "", 2, 0.0, None]:
        with pytest.raises(ValueError, match="option 'lens_norm' of policy 'tokrag' must be true or false"):
            get_policy("tokrag", lens_norm=bad)


def test_unknown_policy_options_name_the_policy_and_list_its_options():
    with pytest.raises(ValueError, match=r"unknown option 'nonsense'; options: pr_norm, pr_skip, top_k"):
        get_policy("tokrag", nonsense=1)
    with pytest.raises(ValueError, match=r"policy 'rag': unknown option 'alpha'; options: none"):
        get_policy("rag", alpha=0.5)


# ============================================================================ point 7 (CLI)
def _run_cli(argv: list[str]) -> tuple[int, str, str]:
    from tokrag_integrations import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def nothing_loads(monkeypatch) -> list[str]:
    """Record (and refuse) retrieval and model loads: the checks must come first."""
    from tokrag_integrations.cli import ask

    calls: list[str] = []

    def load_model(*_: Any, **__: Any) -> Any:
        calls.append("load_model")
        raise AssertionError("the model was loaded before the arguments were checked")

    def retrieve(*_: Any, **__: Any) -> Any:
        calls.append("retrieve")
        raise AssertionError("retrieval ran before the arguments were checked")

    monkeypatch.setattr(tokrag_integrations, "load_model", load_model, raising=False)
    monkeypatch.setattr(ask, "_retrieve", retrieve)
    return calls


def _one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokrag: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cuda"], "device 'cuda' was requested but CUDA is not available on this machine"),
        (["--device", "gpu0"], "unknown device 'gpu0'"),
        (["--dtype", "float99"], "unknown dtype 'float99'; use one of float32, float16, bfloat16"),
        (["--policy", "tokrog"], "Unknown policy 'tokrog'. Available policies: adacad"),
        (["--option", "nonsense=1"], "unknown option 'nonsense'; options: pr_norm"),
        (["--option", "lens_norm=maybe"], "option 'lens_norm' of policy 'tokrag' must be true or false"),
        (["--policy", "rag", "--option", "alpha=0.5"], "policy 'rag': unknown option 'alpha'; options: none"),
        (["--gate", "confidence", "--option", "nonsense=1"], "unknown option 'nonsense'"),
    ],
)
def test_cli_rejects_bad_arguments_before_retrieval_and_model_load(argv, message, nothing_loads, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = _run_cli(["ask", "Who?", "--docs", "sample", *argv])
    assert message in _one_line_error(code, err)
    assert nothing_loads == []


def test_load_model_refuses_unavailable_devices_and_unknown_dtypes(monkeypatch):
    import torch

    from tokrag_integrations import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available on this machine; use device 'cpu'"):
        load_model(device="cuda")
    with pytest.raises(ValueError, match="unknown dtype 'float99'"):
        load_model(device="cpu", dtype="float99")


def test_cli_help_lists_the_policy_names():
    code, out, _ = _run_cli(["ask", "--help"])
    assert code == 0
    text = " ".join(out.split())
    assert "one of adacad, cad, entropy, floor, logprob, no_rag, rag, rag_sequence, rag_token, tokrag" in text
