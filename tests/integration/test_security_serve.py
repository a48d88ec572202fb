"""Issue 43 (server): hostile and careless requests against ``tokrag serve`` on the packaged
model, over real HTTP. Every refused request must be a 4xx that names its field, with no
traceback and no server path; the keep-alive connection survives it.

Cases that need no model or server are in ``tests/unit/test_security_serve.py``."""

from __future__ import annotations

import time

import pytest
from _helpers import LiveServer, require

from tokrag_integrations.defaults import ANSWER_STOP

require("fastapi")
require("uvicorn")
httpx = require("httpx")

QUESTION = "Who founded Quillfeather Aerospace?"
DOCS = ["Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø, Norway."]


def _start(lm, **config):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    service = ChatService(lm, ServeConfig(max_new_tokens=4, **config))
    return LiveServer(create_app(service))


@pytest.fixture(scope="module")
def server(lm):
    live = _start(lm)
    yield live
    live.stop()


def _body(**change):
    return {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 4, "documents": DOCS, **change}


def _post(server, body=None, content=None, headers=None):
    kw = {"content": content} if content is not None else {"json": body}
    return httpx.post(f"{server.url}/v1/chat/completions", headers=headers or {}, timeout=120, **kw)


def _refused(r, param, *words, status=400):
    """``r`` is a JSON error of ``status`` naming ``param``, its message holding ``words``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    assert "Traceback" not in r.text and "/src/" not in r.text and ".py" not in r.text
    return err


def test_13_a_malformed_tool_call_is_refused_naming_its_path(server):
    """Tool calls in the history are taken since issue 57; one without its function is
    refused with its full path, every placeholder filled."""
    body = _body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "user", "content": QUESTION},
    ])
    err = _refused(_post(server, body), "messages[1].tool_calls[0].function",
                   "'messages[1].tool_calls[0].function' is required")
    assert "{" not in err["message"]


def test_08_openapi_schema_needs_the_key_when_one_is_set(lm, monkeypatch):
    monkeypatch.setenv("TOKRAG_API_KEY", "s3cret")
    live = _start(lm)
    try:
        r = httpx.get(f"{live.url}/openapi.json", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(f"{live.url}/openapi.json", timeout=30,
                      headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            assert httpx.get(f"{live.url}{page}", timeout=30).status_code == 404
    finally:
        live.stop()


def test_08_openapi_schema_is_open_without_a_key(server):
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200 and "/v1/models" in r.json()["paths"]


def _same_connection(server, *bodies):
    """POST each body on one keep-alive connection; the responses (status, JSON), and whether
    the connection stayed open throughout."""
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    out, socks = [], []
    try:
        for body in bodies:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.request("POST", "/v1/chat/completions", body=data,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            out.append((r.status, json.loads(r.read())))
            socks.append(conn.sock)
    finally:
        conn.close()
    return out, all(s is not None and s is socks[0] for s in socks)


def test_11_body_nested_200k_deep_is_a_400_on_a_kept_connection(server):
    deep = b"[" * 200_000 + b"]" * 200_000
    body = b'{"messages": ' + deep + b"}"
    (first, second), kept = _same_connection(server, body, {"messages": 5})
    assert first[0] == 400, first
    assert "deeper than this server's limit of 32 levels" in first[1]["error"]["message"]
    assert second[0] == 400 and second[1]["error"]["param"] == "messages"
    assert kept  # the refusal did not drop the connection


def test_11_integer_of_thousands_of_digits_is_a_400(server):
    r = _post(server, content=b'{"max_tokens": ' + b"9" * 5000 + b"}",
              headers={"Content-Type": "application/json"})
    _refused(r, None, "not valid JSON")


def _nested(levels):
    meta = {"leaf": 1}
    for _ in range(levels - 1):
        meta = {"k": meta}
    return meta


def test_12_metadata_nested_300_deep_is_refused_before_the_decode(server):
    docs = [{"text": DOCS[0], "metadata": _nested(300)}]
    (first, second), kept = _same_connection(server, _body(documents=docs), _body())
    assert first[0] == 400, first
    err = first[1]["error"]
    assert err["param"].startswith("documents[0].metadata.k.k")
    assert "deeper than this server's limit of 32 levels" in err["message"]
    assert second[0] == 200 and kept


def test_12_metadata_within_the_limit_comes_back(server):
    meta = _nested(28)  # body, documents, documents[0], metadata: 31 levels with the leaf's
    r = _post(server, _body(documents=[{"text": DOCS[0], "metadata": meta}]))
    assert r.status_code == 200, r.text
    assert r.json()["tokrag"]["sources"][0]["metadata"] == meta


@pytest.mark.parametrize(
    ("raw", "param", "got"),
    [
        (b'{"text": "d", "score": 1' + b"0" * 400 + b"}", "documents[0].score",
         "an integer of 401 digits"),
        (b'{"text": "d", "score": 1e400}', "documents[0].score", "Infinity"),
        (b'{"text": "d", "score": -Infinity}', "documents[0].score", "-Infinity"),
        (b'{"text": "d", "score": NaN}', "documents[0].score", "NaN"),
        (b'{"text": "d", "metadata": {"page": NaN}}', "documents[0].metadata.page", "NaN"),
    ],
)
def test_14_numbers_out_of_range_are_a_400_naming_the_field(server, raw, param, got):
    body = (b'{"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, '
            b'"documents": [' + raw + b"]}")
    r = _post(server, content=body, headers={"Content-Type": "application/json"})
    _refused(r, param, "must be a finite number", got)


def test_14_number_out_of_range_in_options_and_filters(server):
    r = _post(server, content=b'{"messages": [{"role": "user", "content": "Who?"}], '
              b'"tokrag": {"filters": {"chunk": {"$gt": 1' + b"0" * 400 + b'}}}}',
              headers={"Content-Type": "application/json"})
    _refused(r, "tokrag.filters.chunk.$gt", "an integer of 401 digits")
    r = _post(server, content=b'{"messages": [{"role": "user", "content": "Who?"}], '
              b'"tokrag": {"policy_options": {"threshold": Infinity}}}',
              headers={"Content-Type": "application/json"})
    _refused(r, "tokrag.policy_options.threshold", "Infinity")


def test_15_nan_score_on_a_stream_is_refused_before_the_first_byte(server):
    body = (b'{"messages": [{"role": "user", "content": "Who?"}], "max_tokens": 4, '
            b'"stream": true, "documents": [{"text": "d", "score": NaN}]}')
    r = _post(server, content=body, headers={"Content-Type": "application/json"})
    _refused(r, "documents[0].score", "NaN")
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("stream", [False, True])
def test_16_option_the_model_refuses_is_a_400_plain_and_streamed(server, lm, stream):
    from tokrag_integrations.attention.parts import model_parts

    depth = model_parts(lm.model).num_layers
    body = _body(stream=stream, tokrag={"policy_options": {"fixed_layer": 1_000_000}})
    r = _post(server, body)
    _refused(r, "tokrag.policy_options", f"fixed_layer must be in [1, {depth}]")
    assert r.headers["content-type"].startswith("application/json")
    # The refusal left nothing behind: the slot is free, no stream was cut.
    health = server.health()
    assert health["active"] == 0 and health["streams_cut"] == 0


def test_17_non_number_option_is_a_400_naming_it(server):
    for stream in (False, True):
        r = _post(server, _body(stream=stream, tokrag={"policy_options": {"threshold": "abc"}}))
        _refused(r, "tokrag.policy_options",
                 "option 'threshold' of policy 'tokrag' must be a number, got 'abc'")


def test_18_cad_alpha_out_of_range_is_a_400_and_the_largest_still_answers(server, lm):
    from tokrag_integrations import generate

    for stream in (False, True):
        r = _post(server, _body(stream=stream, tokrag={"policy": "cad",
                                                       "policy_options": {"alpha": 1e308}}))
        _refused(r, "tokrag.policy_options", "alpha must be at most 1000")
    # At the bound the contrast is still finite: the answer is the core's, and not empty.
    r = _post(server, _body(tokrag={"policy": "cad", "policy_options": {"alpha": 1000}}))
    assert r.status_code == 200, r.text
    want = generate(lm, QUESTION, DOCS, policy="cad", policy_options={"alpha": 1000},
                    max_new_tokens=4, stop=list(ANSWER_STOP))
    assert r.json()["choices"][0]["message"]["content"] == want.text
    assert want.token_ids and all(s.token_id is not None for s in want.trace.steps)


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'"messages": [{"role": "user", "content": "Who\\ud800?"}]', "messages[0].content"),
        (b'"messages": [{"role": "system", "content": "be \\udfff"}, '
         b'{"role": "user", "content": "Who?"}]', "messages[0].content"),
        (b'"messages": [{"role": "user", "content": "Who?"}], "stop": ["\\ud83d"]', "stop[0]"),
        (b'"messages": [{"role": "user", "content": "Who?"}], '
         b'"documents": [{"text": "d", "metadata": {"\\ud800k": 1}}]', "documents[0].metadata"),
        (b'"messages": [{"role": "user", "content": "Who?"}], '
         b'"tokrag": {"filters": {"file_name": "a\\udc80b"}}', "tokrag.filters.file_name"),
    ],
)
def test_19_lone_surrogate_in_any_string_is_a_400_naming_it(server, raw, param):
    r = _post(server, content=b"{" + raw + b', "max_tokens": 4}',
              headers={"Content-Type": "application/json"})
    _refused(r, param, "is not valid Unicode", "lone surrogate")


def test_19_system_prompt_with_a_lone_surrogate_is_cleaned_like_the_query(lm):
    from tokrag_integrations import generate

    with pytest.warns(UserWarning, match="system_prompt contains 1 lone surrogate"):
        got = generate(lm, QUESTION, DOCS, system_prompt="Answer briefly.\ud800",
                       max_new_tokens=4)
    want = generate(lm, QUESTION, DOCS, system_prompt="Answer briefly.\ufffd", max_new_tokens=4)
    assert got.text == want.text


def test_21_health_shows_no_pid_and_no_load_error_text(server, tmp_path):
    import os

    from tokrag_integrations.server import ServeConfig, create_app

    r = httpx.get(f"{server.url}/health", timeout=30)
    h = r.json()
    assert "pid" not in h
    assert h["replica"] == r.headers["x-tokrag-replica"] != str(os.getpid())
    secret = tmp_path / "private-models" / "weights"

    def loader():
        raise FileNotFoundError(f"no model at {secret}")

    live = LiveServer(create_app(loader=loader, config=ServeConfig()))
    try:
        deadline = time.monotonic() + 60
        while (r := httpx.get(f"{live.url}/health", timeout=30)).json()["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"] == "FileNotFoundError; see the server log"
        chat = _post(live, _body())
        assert chat.status_code == 503 and "FileNotFoundError" in chat.text
        assert str(tmp_path) not in r.text + chat.text
    finally:
        live.stop()
