"""The remote backend without a server: the request a core call becomes, the server's checks
of the new ``tokrag`` keys, base_url with local load options, a server that is down.

Against a real ``tokrag serve``: ``tests/integration/test_remote.py``."""

from __future__ import annotations

import socket

import pytest
from _helpers import require

require("openai")

from tokrag_integrations.langchain import ChatTokRAG  # noqa: E402
from tokrag_integrations.llama_index import TokRAGLLM  # noqa: E402
from tokrag_integrations.prompts import Passage, RenderedPrompt  # noqa: E402
from tokrag_integrations.server import Limits, RequestError, parse_chat_request  # noqa: E402
from tokrag_integrations.server.remote_wire import request_body  # noqa: E402

URL = "http://127.0.0.1:9/v1"
KEY = "unit-key-7731"


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # closed once the socket is


def test_a_core_call_becomes_one_request_and_back():
    rendered = RenderedPrompt("CTX", messages=[{"role": "user", "content": "Notes: CTX Q?"}])
    body = request_body(
        "Q?",
        [],
        {
            "policy": "tokrag",
            "max_new_tokens": 5,
            "stop": None,
            "system_prompt": "Be brief.",
            "messages": [{"role": "assistant", "content": "Hi."}],
            "rendered": rendered,
            "policy_options": {"threshold": 0.0},
            "max_context_tokens": 300,
        },
    )
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Q?"},
    ]
    assert body["stop"] == [] and body["max_tokens"] == 5  # [] = no stop (None: the server's)
    extra = body["extra_body"]
    assert "documents" not in extra  # a rendered call's empty passages are not documents
    assert extra["tokrag"]["rendered"] == {"context": "CTX", "messages": rendered.messages}
    # The server reads it back into the same core arguments.
    req = parse_chat_request(
        {k: v for k, v in body.items() if k != "extra_body"} | extra, Limits(), ["tokrag"]
    )
    assert req.rendered == rendered and req.query == "Q?" and req.system_prompt == "Be brief."
    assert req.history == [{"role": "assistant", "content": "Hi."}]
    assert req.max_context_tokens == 300 and req.options == {"threshold": 0.0}
    docs = request_body("Q?", [("a", 0.5), Passage("b", metadata={"k": 1})], {})
    assert docs["extra_body"]["documents"] == [
        {"text": "a", "score": 0.5, "metadata": {}},
        {"text": "b", "score": None, "metadata": {"k": 1}},
    ]
    with pytest.raises(TypeError, match="cannot take speed"):
        request_body("Q?", None, {"speed": "auto"})
    # A rendered context cut into its documents travels with them, and comes back equal.
    parts = [Passage("C", score=0.9, metadata={"id": "d1"}), Passage("TX", metadata={"id": "d2"})]
    cut = RenderedPrompt("CTX", text="Notes: CTX Q?", passages=parts)
    body = request_body("Q?", [], {"rendered": cut})
    sent = body["extra_body"]["tokrag"]["rendered"]
    assert [d["metadata"]["id"] for d in sent["passages"]] == ["d1", "d2"]
    req = parse_chat_request(
        {k: v for k, v in body.items() if k != "extra_body"} | body["extra_body"],
        Limits(),
        ["tokrag"],
    )
    assert req.rendered == cut


@pytest.mark.parametrize(
    "tokrag, message",
    [
        ({"rendered": {"context": "c"}}, "one of 'messages'"),
        ({"rendered": {"context": "c", "text": "t", "messages": []}}, "one of 'messages'"),
        ({"rendered": {"context": 1, "text": "t"}}, "context' must be a string"),
        (
            {"rendered": {"context": "c", "messages": [{"role": "tool", "content": "x"}]}},
            "role must be",
        ),
        ({"rendered": {"context": "ab", "text": "t", "passages": ["a", "c"]}}, "make up"),
        ({"rendered": {"context": "a", "text": "t", "passages": "a"}}, "must be an array"),
        ({"prompt_format": "xml"}, "'qa', 'chat' or 'text'"),
        ({"max_context_tokens": 0}, "at least 1"),
    ],
)
def test_the_server_checks_the_new_tokrag_keys(tokrag, message):
    body = {"messages": [{"role": "user", "content": "Q?"}], "tokrag": tokrag}
    with pytest.raises(RequestError, match=message):
        parse_chat_request(body, Limits(), ["tokrag"])


def test_rendered_and_documents_are_refused_together():
    body = {
        "messages": [{"role": "user", "content": "Q?"}],
        "documents": ["d"],
        "tokrag": {"rendered": {"context": "c", "text": "c Q?"}},
    }
    with pytest.raises(RequestError, match="not both"):
        parse_chat_request(body, Limits(), ["tokrag"])


@pytest.mark.parametrize("local", [{"model": "default"}, {"dtype": "float32"}, {"device": "cpu"}])
def test_base_url_with_local_load_options_is_refused(local):
    with pytest.raises(ValueError, match="load a local model; with base_url="):
        TokRAGLLM(base_url=URL, **local)
    with pytest.raises(ValueError, match="load a local model; with base_url="):
        ChatTokRAG(base_url=URL, **local)


def test_not_an_http_url_is_refused():
    with pytest.raises(ValueError, match="http"):
        TokRAGLLM(base_url="127.0.0.1:8000")


def test_a_server_that_is_down_is_one_sentence_naming_it_and_never_the_key():
    url = _closed_port_url()
    for model in (
        TokRAGLLM(base_url=url, api_key=KEY, max_retries=0),
        ChatTokRAG(base_url=url, api_key=KEY, max_retries=0),
    ):
        assert KEY not in repr(model) and KEY not in str(model)
        with pytest.raises(
            ConnectionError, match=f"cannot connect to the tokrag server at {url}"
        ) as e:
            model.invoke("Q?", policy="no_rag") if isinstance(model, ChatTokRAG) else model.complete(
                "Q?"
            )
        assert KEY not in str(e.value)
    with pytest.raises(ValueError, match="holds no model"):
        TokRAGLLM(base_url=url).loaded_model  # noqa: B018 - the property raises
