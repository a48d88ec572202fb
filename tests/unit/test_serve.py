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


# ============================================================================ request bodies
@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"max_tokens": "4"}, "max_tokens", "'max_tokens' must be an integer, got string"),
        ({"max_tokens": True}, "max_tokens", "must be an integer, got boolean"),
        ({"stream": 1}, "stream", "'stream' must be true or false, got integer"),
        ({"documents": [{"text": "d", "score": "high"}]}, "documents[0].score", "must be a number"),
        ({"documents": [{"text": "d", "extra": 1}]}, "documents[0]", "unknown key(s) extra"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "got 'function'"),
            ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "without the 'tool_call_id'"),
            ({"temperature": 2.5}, "temperature", "'temperature' must be at most 2"),
            ({"top_p": 0}, "top_p", "'top_p' must be above 0"),
            ({"n": 9}, "n", "more than this server's limit of 8 choices"),
            ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs': true"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
            ({"seed": -1}, "seed", "at least 0"),
            ({"response_format": {"type": "xml"}}, "response_format.type", "got 'xml'"),
            ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
            ({"tool_choice": "auto"}, "tool_choice", "'tool_choice' needs 'tools'"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
             "tool_choice", "got 'sometimes'"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}},
             "tool_choice.function.name", "'g', which is not among 'tools' (f)"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "names f more than once"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}],
              "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
            ({"functions": [{"name": "f"}]}, "functions", "this server takes 'tools'"),
            ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]},
                {"role": "user", "content": "q"}]},
             "messages[1].tool_calls[0].function.arguments", "holding an object, got a JSON array"),
            ({"tokrag": {"constraint": {"type": "regex"}}}, "tokrag.constraint", "non-empty 'regex'"),
        ({"tokrag": {"top_k": 0}}, "tokrag.top_k", "'tokrag.top_k' must be at least 1, got 0"),
        ({"tokrag": {"prompt_format": "xml"}}, "tokrag.prompt_format", "'qa', 'chat' or 'text'"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "holds 5 items; at most 4"),
    ],
)
def test_a_body_the_model_refuses_is_one_sentence_naming_the_field(change, param, words):
    """Issue 55: the body is a pydantic model (ChatBody); its first error is the 400."""
    from tokrag_integrations.server import Limits, RequestError, parse_chat_request

    body = {"messages": [{"role": "user", "content": "Who?"}], **change}
    with pytest.raises(RequestError) as info:
        parse_chat_request(body, Limits(), ["rag", "tokrag"])
    assert info.value.param == param and info.value.status == 400
    assert words in str(info.value) and "\n" not in str(info.value)
    assert "pydantic" not in str(info.value) and "Input should" not in str(info.value)


def test_a_body_splits_like_the_adapters_conversations():
    from tokrag_integrations.server import Limits, parse_chat_request

    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "part one"}]},
            {"role": "user", "content": "part two"},
        ],
        "stop": "\n", "user": "u1", "documents": ["d", {"text": "e", "score": 1, "metadata": {"k": 1}}],
    }
    req = parse_chat_request(body, Limits(), ["tokrag"])
    assert (req.query, req.system_prompt) == ("part one\n\npart two", "Be brief.")
    assert req.history == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}]
    assert req.stop == ["\n"] and req.warnings == ["ignored field(s) this server does not use: user"]
    assert [(d.text, d.score, d.metadata) for d in req.documents] == [("d", None, {}), ("e", 1.0, {"k": 1})]
