"""Issue 43 (server): the guards of ``tokrag serve`` that need no model or server. The cases
against a real server are in ``tests/integration/test_security_serve.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _app(**config):
    from tokrag_integrations.serve import ServeConfig, create_app

    return create_app(loader=lambda: None, config=ServeConfig(**config))


# ============================================================================ API key (9, 10)
def test_09_empty_key_is_refused_flag_and_environment_alike(monkeypatch):
    monkeypatch.delenv("TOKRAG_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key is empty"):
        _app(api_key="")
    monkeypatch.setenv("TOKRAG_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$TOKRAG_API_KEY is empty"):
        _app()
    monkeypatch.delenv("TOKRAG_API_KEY")
    _app()  # unset: no auth, as before


def test_09_cli_refuses_an_empty_key_before_loading(monkeypatch, capsys):
    from tokrag_integrations.cli import main

    monkeypatch.delenv("TOKRAG_API_KEY", raising=False)
    import tokrag_integrations.serve.runner as runner

    # Were the key let through, the command would start a server: fail loudly instead.
    monkeypatch.setattr(runner, "serve", lambda *a, **k: pytest.fail("the server started"))
    assert main(["serve", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "Traceback" not in err
    monkeypatch.setenv("TOKRAG_API_KEY", "")
    assert main(["serve"]) == 2
    assert "$TOKRAG_API_KEY is empty" in capsys.readouterr().err
