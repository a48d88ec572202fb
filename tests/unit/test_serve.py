"""``tokrag serve``: the OpenAI-compatible server on the packaged model, through real clients.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_serve.py``."""

from __future__ import annotations

import pytest
from _helpers import require

require("fastapi")
require("uvicorn")




# ============================================================================ command line
def test_cli_serve_flags_become_the_config():
    from tokrag_integrations.cli import build_parser
    from tokrag_integrations.cli.serve import config_from_args

    args = build_parser().parse_args([
        "serve", "--policy", "rag", "--option", "top_k=2", "--max-tokens-limit", "64",
        "--max-queue", "3", "--batch-wait-ms", "20", "--store", "postgres", "--table", "kb",
        "--top-k", "2", "--no-stop", "--max-rows", "8", "--max-positions", "4096",
        "--no-continuous-batching", "--max-prefill-tokens", "512", "--metrics", "open",
    ])
    c = config_from_args(args)
    assert (c.policy, c.policy_options, c.limits.max_tokens, c.max_queue) == ("rag", {"top_k": 2}, 64, 3)
    assert (c.batch_wait_s, c.store, c.table, c.top_k, c.stop) == (0.02, "postgres", "kb", 2, None)
    assert (c.max_rows, c.max_positions, c.continuous, c.max_prefill_tokens) == (8, 4096, False, 512)
    assert c.metrics == "open"
    assert config_from_args(build_parser().parse_args(["serve"])).continuous is True
    assert config_from_args(build_parser().parse_args(["serve"])).metrics == "key"
    assert args.host == "127.0.0.1"  # localhost unless told otherwise


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--policy", "nope"], "Unknown policy 'nope'"),
        (["serve", "--option", "no_such_option=1"], "no_such_option"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--ray", "--autoscale", "3:1"], "--autoscale"),
    ],
)
def test_cli_serve_refuses_bad_flags_before_loading(argv, message, capsys):
    from tokrag_integrations.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_binding_beyond_localhost_without_a_key_warns(monkeypatch):
    from tokrag_integrations.server.app import is_local, warn_if_open
    from tokrag_integrations.server.service import ServeConfig

    monkeypatch.delenv("TOKRAG_API_KEY", raising=False)
    assert is_local("127.0.0.1") and is_local("::1") and is_local("localhost")
    assert not is_local("0.0.0.0")
    with pytest.warns(UserWarning, match="without an API key"):
        warn_if_open("0.0.0.0", ServeConfig())
