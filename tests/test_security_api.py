"""Issue 29, library side: streams closed early, bad numbers and roles, a damaged model cache.

Each test replays one case of the second security probe on the real default model; the
exit-status cases run a fresh interpreter, since the failure happened at interpreter exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


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
