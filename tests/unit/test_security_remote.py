"""Issue 54 (remote clients), the checks that need no server: credentials in ``base_url``
refused and never echoed, the client's number options, :meth:`Trace.from_dict` refusing
data a :class:`Trace` could not hold, the request log's path encoding.

Hostile servers: ``tests/integration/test_security_remote.py``."""

from __future__ import annotations

import logging

import pytest
from _helpers import require

require("openai")

from tokrag_integrations.langchain import ChatTokRAG  # noqa: E402
from tokrag_integrations.llama_index import TokRAGLLM  # noqa: E402
from tokrag_integrations.server.client import RemoteModel  # noqa: E402
from tokrag_integrations.server.remote_guards import redacted  # noqa: E402
from tokrag_integrations.server.telemetry import MAX_LOGGED_PATH, logged_path  # noqa: E402
from tokrag_integrations.trace import Citation, PassageRecord, Trace, TraceStep  # noqa: E402

WITH_CREDENTIALS = [
    "http://alice:secret@127.0.0.1:9/v1",
    "https://alice:secret@gpu-box/v1",
    "http://secret@127.0.0.1:9/v1",
    "http://a:secret@b@127.0.0.1:9/v1",
    "HTTP://alice:secret@127.0.0.1:9/v1",
]


@pytest.mark.parametrize("url", WITH_CREDENTIALS)
def test_07_credentials_in_base_url_are_refused_without_being_echoed(url, caplog):
    caplog.set_level(logging.DEBUG)
    for make in (
        lambda: RemoteModel(url),
        lambda: TokRAGLLM(base_url=url),
        lambda: ChatTokRAG(base_url=url),
    ):
        with pytest.raises(ValueError) as e:
            make()
        text = str(e.value)
        assert "secret" not in text and "***@" in text, text
        assert "api_key=" in text or "http(s) URL" in text
    assert "secret" not in caplog.text


@pytest.mark.parametrize(
    "url", ["ftp://bob:secret@127.0.0.1/v1", "bob:secret@127.0.0.1:8000/v1", "//bob:secret@h/v1"]
)
def test_07_an_unsupported_url_is_refused_without_its_password(url):
    for make in (lambda: RemoteModel(url), lambda: ChatTokRAG(base_url=url)):
        with pytest.raises(ValueError, match=r"must be an http\(s\) URL") as e:
            make()
        assert "secret" not in str(e.value) and "***@" in str(e.value)


def test_redacted_keeps_the_rest_of_the_url():
    assert redacted("http://alice:secret@host:8000/v1?x=1") == "http://***@host:8000/v1?x=1"
    assert redacted("http://a:b@c@host/v1") == "http://***@host/v1"
    assert redacted("ftp://bob:pw@h/") == "ftp://***@h/"
    assert redacted("http://host/v1?mail=a@b") == "http://host/v1?mail=a@b"  # not userinfo
    assert redacted("http://host:8000/v1") == "http://host:8000/v1"


@pytest.mark.parametrize(
    "option, value",
    [
        ("timeout", 0),
        ("timeout", float("nan")),
        ("timeout", 10**400),
        ("timeout", "soon"),
        ("timeout", 1e12),
        ("max_response_mb", -1),
        ("max_response_mb", float("inf")),
        ("max_retries", -1),
        ("max_retries", 1.5),
    ],
)
def test_client_options_are_checked_by_name(option, value):
    with pytest.raises(ValueError, match=f"{option} must be"):
        RemoteModel("http://127.0.0.1:9/v1", **{option: value})


def test_the_size_cap_has_one_default_everywhere():
    import inspect

    from tokrag_integrations.defaults import REMOTE_MAX_RESPONSE_MB

    sig = inspect.signature(RemoteModel.__init__).parameters["max_response_mb"]
    assert sig.default == REMOTE_MAX_RESPONSE_MB == 32
    assert TokRAGLLM.model_fields["max_response_mb"].default == REMOTE_MAX_RESPONSE_MB
    assert ChatTokRAG.model_fields["max_response_mb"].default == REMOTE_MAX_RESPONSE_MB


# ------------------------------------------------------------------ Trace.from_dict
def _trace() -> Trace:
    steps = [
        TraceStep(0, 11, "Ada", "rag", citation=[0.75, 0.25]),
        TraceStep(1, 12, ".", "agree", citation=[0.5, 0.5]),
    ]
    passages = [
        PassageRecord(0, "a"),
        PassageRecord(1, "b", cut=True),
        PassageRecord(2, "c", kept=False),
    ]
    return Trace("Q?", "tokrag", steps=steps, passages=passages, text="Ada.")


def test_a_trace_round_trips_through_its_checks():
    d = _trace().to_dict()
    back = Trace.from_dict(d)
    assert back.to_dict() == d
    assert back.cite(0, 2) == (0, 0.625)
    assert [c.passage for c in back.citations()] == [0]
    assert isinstance(back.citations()[0], Citation) and back.to_html()


def _changed(path: list, value):
    d = _trace().to_dict()
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


@pytest.mark.parametrize(
    "path, value, message",
    [
        (["steps"], "abc", "trace.steps is a str, not a list"),
        (["steps", 0], 7, r"trace.steps\[0\] is a int, not an object"),
        (["steps", 0, "token_id"], "11", r"trace.steps\[0\].token_id is a str, not a int"),
        (["steps", 1, "citation"], [0.1] * 50003, r"steps\[1\].citation has 50003 shares, not one"),
        (["steps", 1, "citation"], [0.1, "x"], r"steps\[1\].citation holds something other"),
        (
            ["steps", 0, "candidates"],
            {"rag": {"token_id": 1}},
            r"candidates\['rag'\] has no 'text'",
        ),
        (["steps", 0, "stats"], {"rag": [1]}, r"stats\['rag'\] is not numbers by name"),
        (["passages", 0, "kept"], "yes", r"passages\[0\].kept is a str, not a bool"),
        (["passages", 0, "extra"], 1, r"passages\[0\] has an unknown field 'extra'"),
        (["warnings"], [1], r"trace.warnings\[0\] is a int, not a str"),
        (["query"], None, "trace.query is a NoneType, not a str"),
        (["evil"], 1, "trace has an unknown field 'evil'"),
    ],
)
def test_a_trace_that_a_trace_cannot_hold_is_one_value_error_naming_the_field(path, value, message):
    with pytest.raises(ValueError, match=message):
        Trace.from_dict(_changed(path, value))


def test_a_trace_without_its_required_fields_names_them():
    with pytest.raises(ValueError, match="trace has no 'policy'"):
        Trace.from_dict({"query": "Q?"})
    with pytest.raises(ValueError, match="trace is a list, not an object"):
        Trace.from_dict([])


def test_null_numbers_written_for_nan_are_accepted():
    """The server writes NaN as null in strict JSON: signals, stats, probabilities."""
    d = _trace().to_dict()
    d["steps"][0]["candidates"] = {"rag": {"token_id": 11, "text": "Ada", "prob": None}}
    d["steps"][0]["stats"] = {"rag": {"entropy": None}}
    d["timings"] = {"decode_s": None}
    assert Trace.from_dict(d).steps[0].candidates["rag"].prob is None


# ------------------------------------------------------------------ the request log
def test_logged_path_is_percent_encoded_and_bounded():
    assert logged_path("/v1/chat/completions") == "/v1/chat/completions"
    forged = logged_path("/x 200 0.001s request_id=forged\nGET /v1/models 200")
    assert forged == "/x%20200%200.001s%20request_id=forged%0AGET%20/v1/models%20200"
    assert logged_path("/a%20b") == "/a%2520b"  # a literal % is encoded too: unambiguous
    assert logged_path("/\ud800é") == "/%ED%A0%80%C3%A9"
    long = logged_path("/" + "a" * 10_000)
    assert len(long) == MAX_LOGGED_PATH and long.endswith("...")
