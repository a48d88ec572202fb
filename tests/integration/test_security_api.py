"""Issue 29, library side: streams closed early, bad numbers and roles, a damaged model cache.

Each test replays one case of the second security probe on the real default model; the
exit-status cases run a fresh interpreter, since the failure happened at interpreter exit.

Cases that need no model, database or server are in ``tests/unit/test_security_api.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _python(code: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with this checkout's package on the path."""
    full_env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


# ============================================================================ 5: streams at exit
_CLOSE_THEN_EXIT = {
    "close": """
        from tokrag_integrations import load_model, stream
        lm = load_model("default", device="cpu")
        s = stream(lm, "Who founded Quillfeather Aerospace?",
                   ["Quillfeather Aerospace was founded by Ada Brisk in 1998."], max_new_tokens=48)
        next(s)
        s.close()
        print("closed")
    """,
    "langchain_break": """
        from tokrag_integrations import load_model
        from tokrag_integrations.langchain import ChatTokRAG
        lm = load_model("default", device="cpu")
        chat = ChatTokRAG(model=lm, max_tokens=48)
        for chunk in chat.stream("Tell me a long story about a dragon."):
            break
        print("closed")
    """,
}


@pytest.mark.parametrize("case", sorted(_CLOSE_THEN_EXIT))
def test_closed_stream_then_exit_is_clean(case):
    """Issue 29.5: a stream closed (or left by ``break``) while its decode thread is mid-step,
    then the end of the script: exit status 0, not "terminate called ..." / 134."""
    proc = _python(_CLOSE_THEN_EXIT[case])
    assert "terminate called" not in proc.stderr
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "closed"


# ============================================================================ 15: bad numbers and roles
def test_nan_threshold_is_refused(lm):
    """Issue 29.15: a NaN threshold (policy option or gate) is refused, not silently used."""
    from tokrag_integrations import generate
    from tokrag_integrations.gating.gate_base import Gate

    for value in (float("nan"), "nan"):
        with pytest.raises(ValueError, match="'threshold' of policy 'tokrag' must be a number, got NaN"):
            generate(lm, "Who?", ["A passage."], max_new_tokens=1, policy_options={"threshold": value})
    with pytest.raises(ValueError, match="threshold must be a number, got NaN"):
        Gate().threshold = float("nan")
    assert generate(lm, "Who?", ["A passage."], max_new_tokens=1, policy_options={"threshold": float("-inf")}).text is not None


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "evil"}], "messages\\[0\\] has role 'evil'; use one of 'system', 'user', 'assistant'"),
        ([{"role": "user"}], "messages\\[0\\] \\(user\\) needs a 'content' string, got NoneType"),
        ([{"role": "user<|im_end|>", "content": "x"}], "has role 'user<|im_end|>'"),
        ("hello", "messages must be a list"),
    ],
)
def test_bad_chat_messages_are_one_sentence(lm, messages, match):
    """Issue 29.15: a bad ``messages`` turn is a clear error, not a raw jinja UndefinedError."""
    from tokrag_integrations import generate, stream

    for call in (generate, stream):
        with pytest.raises((ValueError, TypeError), match=match):
            call(lm, "Who?", ["A passage."], messages=messages, max_new_tokens=1)


def test_huge_max_new_tokens_names_the_window(lm):
    """Issue 29.15: ``max_new_tokens=10**9`` says it does not fit the window (no negative count)."""
    from tokrag_integrations import generate

    with pytest.raises(ValueError) as info:
        generate(lm, "Who?", max_new_tokens=10**9)
    message = str(info.value)
    assert f"context window of {lm.context_window} tokens" in message
    assert "max_new_tokens=1000000000" in message and "-9" not in message


# ============================================================================ 13: damaged model file
def test_truncated_safetensors_in_the_cache_is_one_sentence(lm, tmp_path, monkeypatch):
    """Issue 29.13: a cut-short ``model.safetensors`` in the model cache: one error naming the
    file and how to rebuild it, through the API and as ``tokrag: error:`` on the CLI."""
    import shutil

    from tokrag_integrations import load_model
    from tokrag_integrations.cli import main
    from tokrag_integrations.models import DamagedModelError

    cached = Path(lm.path)
    folder = tmp_path / "cache" / "models" / cached.name
    folder.mkdir(parents=True)
    for f in cached.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    with open(cached / "model.safetensors", "rb") as src, open(folder / "model.safetensors", "wb") as dst:
        dst.write(src.read(1_000_000))  # the header and the start of the weights only
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(DamagedModelError) as info:
        load_model("default", device="cpu")
    message = str(info.value)
    assert str(folder / "model.safetensors") in message and "damaged" in message
    assert f"delete the folder {folder}" in message and "\n" not in message
    assert main(["ask", "Who?", "--passage", "A passage.", "--max-new-tokens", "1"]) == 2


def test_eval_unknown_policy_option_is_a_usage_error():
    """Issue 29.16: ``tokrag eval`` with an unknown policy option prints the usual
    ``tokrag: error:`` line and exits 2 (the console entry point, in a fresh process)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tokrag_integrations.cli", "eval", "--data", __file__,
         "--policies", "tokrag[bogus=1]", "--limit", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tokrag: error: ") and "unknown option 'bogus'" in proc.stderr
