"""Issue 43 (server): the guards of ``tokrag serve`` that need no model or server. The cases
against a real server are in ``tests/integration/test_security_serve.py``."""

from __future__ import annotations

import pytest
from _helpers import require

require("fastapi")
require("uvicorn")


def _app(**config):
    from tokrag_integrations.server import ServeConfig, create_app

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
    import tokrag_integrations.server.app as runner

    # Were the key let through, the command would start a server: fail loudly instead.
    monkeypatch.setattr(runner, "serve", lambda *a, **k: pytest.fail("the server started"))
    assert main(["serve", "--api-key", ""]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "Traceback" not in err
    monkeypatch.setenv("TOKRAG_API_KEY", "")
    assert main(["serve"]) == 2
    assert "$TOKRAG_API_KEY is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "words"),
    [
        ("k3y ", "whitespace"),
        (" k3y", "whitespace"),
        ("k3y\n", "whitespace"),
        ("k3\ty", "'\\t' at position 2"),
        ("k3y\x00x", "'\\x00' at position 3"),
        ("k3y\x7f", "'\\x7f' at position 3"),
        ("clé", "'\\xe9' at position 2"),
    ],
)
def test_10_key_no_client_could_send_is_refused(key, words, monkeypatch):
    if "\x00" not in key:  # an environment variable cannot hold NUL
        monkeypatch.setenv("TOKRAG_API_KEY", key)
        with pytest.raises(ValueError, match=r"\$TOKRAG_API_KEY") as info:
            _app()
        assert words in str(info.value)
        monkeypatch.delenv("TOKRAG_API_KEY")
    with pytest.raises(ValueError, match="--api-key") as info:
        _app(api_key=key)
    assert words in str(info.value)


def test_10_printable_keys_with_inner_spaces_are_kept(monkeypatch):
    from tokrag_integrations.server import ServeConfig

    monkeypatch.setenv("TOKRAG_API_KEY", "a b~!{}")
    assert ServeConfig().resolved_api_key() == "a b~!{}"


# ============================================================================ streams (15)
def _strict(text):
    import json

    def refuse(constant):
        raise AssertionError(f"{constant} in an event")

    return json.loads(text, parse_constant=refuse)


def test_15_stream_events_never_hold_nan_or_infinity():
    from tokrag_integrations.server.streaming import sse

    data = {"score": float("nan"), "steps": [{"gap": float("inf")}, (float("-inf"), 1.5)],
            "text": "é", "n": 3}
    event = sse(data).decode()
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert _strict(event[len("data: "):]) == {
        "score": None, "steps": [{"gap": None}, [None, 1.5]], "text": "é", "n": 3}


# ============================================================================ policy options (17, 18)
@pytest.mark.parametrize(
    ("policy", "option", "value"),
    [("tokrag", "threshold", "abc"), ("tokrag", "jsd_threshold", [1]),
     ("tokrag", "plausibility_alpha", {}), ("rag_token", "temperature", "hot"),
     ("cad", "alpha", "0.5"), ("tokrag", "threshold", True)],
)
def test_17_non_number_for_a_number_option_names_it(policy, option, value):
    from tokrag_integrations.policies import get_policy

    with pytest.raises(ValueError) as info:
        get_policy(policy, **{option: value})
    assert str(info.value) == (
        f"option {option!r} of policy {policy!r} must be a number, got {value!r}")


def test_17_numbers_and_none_still_pass():
    from tokrag_integrations.policies import get_policy

    p = get_policy("tokrag", threshold=0.25, top_k=None, fixed_layer=3, plausibility_alpha=None)
    assert (p.threshold, p.top_k, p.fixed_layer) == (0.25, None, 3)


@pytest.mark.parametrize("alpha", [1e308, float("inf"), 1000.5, 10**400])
def test_18_cad_refuses_an_absurd_alpha_with_its_range(alpha):
    from tokrag_integrations.policies import get_policy

    with pytest.raises(ValueError, match=r"alpha must be at most 1000 \(the CAD paper uses 0.5"):
        get_policy("cad", alpha=alpha)
    assert get_policy("cad", alpha=1000).alpha == 1000.0
