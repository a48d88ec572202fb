"""Issue 29, library side: streams closed early, bad numbers and roles, a damaged model cache.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_security_api.py``."""

from __future__ import annotations

import pytest


# ============================================================================ 16: CLI errors
def test_unwritable_cache_folder_is_named_with_its_variable(tmp_path, monkeypatch, capsys):
    """Issue 29.16: a cache folder that cannot be written: the error says it is tokrag's cache
    folder and names $TOKRAG_CACHE_DIR (before the slow model conversion)."""
    from tokrag_integrations import load_model
    from tokrag_integrations.cli import main
    from tokrag_integrations.config import CacheDirError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(CacheDirError, match=r"tokrag's cache folder .*a-file/cache .*set \$TOKRAG_CACHE_DIR"):
        load_model("default", device="cpu")
    assert main(["ask", "Who?", "--passage", "A passage.", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("tokrag: error: Cannot write") and "TOKRAG_CACHE_DIR" in err
