"""The ``tokrag`` command line run in-process, with a fake engine in place of the model:
shared by ``tests/unit/test_cli.py`` and ``tests/integration/test_cli.py``."""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field
from typing import Any

import pytest

import tokrag_integrations
from tokrag_integrations import cli
from tokrag_integrations.trace import Candidate, Trace, TraceStep

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``tokrag argv`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse errors and --help
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------ fake engine
@dataclass
class _Event:
    text: str
    source: str


@dataclass
class _Result:
    text: str
    trace: Trace


@dataclass
class _FakeStream:
    events: list[_Event]
    result: _Result
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __iter__(self):
        return iter(self.events)


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace load_model and stream with fakes; record what the CLI passed them."""
    seen: dict[str, Any] = {}

    def load_model(name_or_path: str = "default", *, device: Any = None, dtype: Any = None):
        seen["load"] = {"name_or_path": name_or_path, "device": device, "dtype": dtype}
        if name_or_path == "missing":
            raise FileNotFoundError("No model found at missing")
        return "LM"

    def stream(lm: Any, query: str, passages: Any, **kw: Any) -> _FakeStream:
        seen["stream"] = {"lm": lm, "query": query, "passages": passages, **kw}
        if kw.get("policy") == "nope":
            raise ValueError("Unknown policy 'nope'. Available policies: no_rag, rag, tokrag.")
        steps = [
            TraceStep(0, 1, "Ottoline", "agree", {"rag": Candidate(1, "Ottoline", 0.9)}),
            TraceStep(
                1,
                2,
                " Varga",
                "rag",
                {"rag": Candidate(2, " Varga", 0.8), "pure": Candidate(3, " Smith", 0.1)},
                {"l_star": 17, "cos_ir": 0.61, "cos_llm": 0.2},
            ),
        ]
        trace = Trace(
            query=query,
            policy=kw["policy"],
            steps=steps,
            text="Ottoline Varga",
            warnings=["one passage was cut"],
            stop_reason="length" if kw.get("max_new_tokens") == 2 else "eos",
        )
        return _FakeStream([_Event(s.text, s.source) for s in steps], _Result(trace.text, trace))

    monkeypatch.setattr(tokrag_integrations, "load_model", load_model, raising=False)
    monkeypatch.setattr(tokrag_integrations, "stream", stream, raising=False)
    return seen
