"""``tokrag serve``: the OpenAI-compatible server on the packaged model, through real clients.

One uvicorn server per configuration for the whole module (in a thread, on a free port,
answering with the session's shared model). Answers are compared with the core API's own
answers, so every test can fail.

Cases that need no model, database or server are in ``tests/unit/test_serve.py``."""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _helpers import LiveServer, interrupt, require, wait_until_healthy

require("fastapi")
require("uvicorn")
openai = require("openai")
httpx = require("httpx")

from tokrag_integrations import generate  # noqa: E402
from tokrag_integrations.defaults import ANSWER_STOP  # noqa: E402

from .test_citations import FACT, ON_TOPIC, WITH_FACT  # noqa: E402
from .test_citations import QUESTION as CITE_QUESTION  # noqa: E402

DOCS = [
    "Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø, Norway.",
    "The company builds reusable sounding rockets for atmospheric research.",
]
QUESTION = "Who founded Quillfeather Aerospace?"
QUESTIONS = [
    QUESTION,
    "Where was Quillfeather Aerospace founded?",
    "What does Quillfeather Aerospace build?",
    "In which year was Quillfeather Aerospace founded?",
]
MAX_TOKENS = 16


def _start(lm, **config):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    service = ChatService(lm, ServeConfig(**config))
    return LiveServer(create_app(service)), service


@pytest.fixture(scope="module")
def server(lm):
    live, service = _start(lm, max_new_tokens=MAX_TOKENS)
    live.service = service
    yield live
    live.stop()


def _ask(client, question=QUESTION, documents=DOCS, **kw):
    extra = dict(kw.pop("extra_body", {}))
    if documents is not None:
        extra["documents"] = documents
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": question}],
        max_tokens=kw.pop("max_tokens", MAX_TOKENS), extra_body=extra, **kw,
    )


_CORE: dict = {}


def _core(lm, question=QUESTION, documents=DOCS, policy="tokrag", **kw):
    """The core API's answer, decoded once per module for each distinct request (decoding is
    deterministic; the tests compare many server answers with the same few)."""
    key = (id(lm), question, repr(documents), policy, repr(sorted(kw.items())))
    if key not in _CORE:
        _CORE[key] = generate(lm, question, documents, policy=policy, max_new_tokens=MAX_TOKENS,
                              stop=list(ANSWER_STOP), **kw)
    return _CORE[key]


# ============================================================================ basics
def test_health_and_models(server, lm):
    h = server.health()
    assert h["status"] == "ok" and h["model"] == lm.name and h["active"] == 0
    models = server.client().models.list()
    assert [m.id for m in models.data] == [lm.name]
    r = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert r.headers["x-tokrag-replica"] == h["replica"]  # this app answered


def test_documents_give_the_tokrag_answer_with_its_trace(server, lm):
    r = _ask(server.client())
    want = _core(lm)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == {"length": "length"}.get(want.stop_reason, "stop")
    t = r.model_extra["tokrag"]
    assert t["policy"] == "tokrag"
    assert t["counts"] == want.trace.counts()
    assert [s["source"] for s in t["trace"]["steps"]] == [s.source for s in want.trace.steps]
    assert t["trace"]["text"] == want.text
    assert [s["text"] for s in sorted(t["sources"], key=lambda s: s["rank"])] == DOCS
    assert r.usage.completion_tokens == len(want.token_ids)
    # Issue 55: the adapters' count (adapters.translate.usage): every context tokrag decoded.
    assert r.usage.prompt_tokens == want.trace.prompt_tokens["rag"] + want.trace.prompt_tokens["pure"]


def test_policy_options_and_trace_switch(server, lm):
    r = _ask(server.client(), extra_body={"tokrag": {"policy": "rag", "trace": False}})
    assert r.choices[0].message.content == _core(lm, policy="rag").text
    assert r.model_extra["tokrag"]["policy"] == "rag"
    assert r.model_extra["tokrag"]["trace"] is None


def test_no_documents_answers_from_the_model_and_says_so(server, lm):
    r = _ask(server.client(), documents=None)
    assert r.choices[0].message.content == _core(lm, documents=None).text
    assert any("no usable passages" in w for w in r.model_extra["tokrag"]["warnings"])


def test_document_objects_with_metadata_and_score(server, lm):
    docs = [{"text": DOCS[0], "metadata": {"source": "a.md"}, "score": 0.9}, DOCS[1]]
    r = _ask(server.client(), documents=docs)
    sources = sorted(r.model_extra["tokrag"]["sources"], key=lambda s: s["rank"])
    assert sources[0]["metadata"] == {"source": "a.md"} and sources[0]["score"] == 0.9
    assert r.choices[0].message.content == _core(lm).text


def test_system_and_history_are_passed_to_the_core(server, lm):
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]
    r = server.client().chat.completions.create(
        model="default", max_tokens=MAX_TOKENS,
        messages=[{"role": "system", "content": "Answer in one short sentence."}, *history,
                  {"role": "user", "content": QUESTION}],
        extra_body={"documents": DOCS},
    )
    want = _core(lm, messages=history, system_prompt="Answer in one short sentence.")
    assert r.choices[0].message.content == want.text


# ============================================================================ streaming
def test_stream_equals_the_plain_answer(server):
    client = server.client()
    plain = _ask(client)
    chunks = list(_ask(client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and all(c.model_extra["tokrag"]["source"] in ("agree", "rag", "pure")
                           for c in content)
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == plain.choices[0].finish_reason
    assert last.model_extra["tokrag"]["counts"] == plain.model_extra["tokrag"]["counts"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_client_that_disconnects_mid_stream_frees_its_slot(server, lm):
    body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "documents": DOCS, "stream": True, "max_tokens": 400, "stop": [],
            "tokrag": {"policy": "no_rag"}}
    cut_before = server.health()["streams_cut"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        got = []
        for line in r.iter_lines():  # read the role chunk and two content chunks, then hang up
            if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                got.append(line)
                if len(got) == 2:
                    break
        assert len(got) == 2
    deadline = time.monotonic() + 60
    while (h := server.health())["active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert h["active"] == 0
    assert h["streams_cut"] == cut_before + 1  # ended before its answer: the decode stopped
    assert lm.lock.acquire(timeout=30)  # the model is free again
    lm.lock.release()
    assert _ask(server.client()).choices[0].message.content == _core(lm).text


# ============================================================================ concurrency
def test_eight_concurrent_requests_equal_their_solo_answers(server, lm):
    questions = QUESTIONS * 2
    solo = {q: _core(lm, question=q).text for q in QUESTIONS}
    client = server.client()
    batches_before = server.service.batcher.batches
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: _ask(client, question=q), questions))
    assert [a.choices[0].message.content for a in answers] == [solo[q] for q in questions]
    assert server.service.batcher.batches > batches_before  # decoded together, not one by one
    stats = server.health()["batching"]
    assert stats["continuous"] is True and stats["batched_calls"] >= 2
    assert 2 <= stats["peak_rows"] <= stats["max_rows"]


def test_concurrent_streams_share_a_decode(server, lm):
    """Streamed requests go through the micro-batcher too: four streams at once are decoded
    together, and every stream's text is its solo answer."""
    solo = {q: _core(lm, question=q).text for q in QUESTIONS}
    client = server.client()
    before = server.service.batcher.batched_calls

    def streamed(q):
        return "".join(c.choices[0].delta.content or "" for c in _ask(client, question=q, stream=True) if c.choices)

    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(streamed, QUESTIONS))
    assert texts == [solo[q] for q in QUESTIONS]
    assert server.service.batcher.batched_calls >= before + 2  # the streams alone shared a decode
    assert server.health()["active"] == 0


# ============================================================================ citations
def _cited_fact(citations: list[dict]) -> list[dict]:
    """The citation spans whose text overlaps the fact (the spans tile the answer)."""
    full = "".join(c["text"] for c in citations)
    at = full.find(FACT)
    assert at >= 0, f"the answer lacks the fact: {full!r}"
    spans, pos = [], 0
    for c in citations:
        if pos < at + len(FACT) and pos + len(c["text"]) > at:
            spans.append(c)
        pos += len(c["text"])
    return spans


def test_citations_name_the_passage_holding_the_fact_in_either_order(server):
    """Issue 46's acceptance through the openai client: the fact's span is cited to the
    passage holding it, first or second; sources come by contribution, that passage first;
    the last chunk of a stream carries the same citations; ``trace: false`` keeps them."""
    client = server.client()
    for docs, holder in (([ON_TOPIC, WITH_FACT], 1), ([WITH_FACT, ON_TOPIC], 0)):
        documents = [{"text": d.text, "metadata": d.metadata} for d in docs]
        kw = {"max_tokens": 22, "extra_body": {"tokrag": {"trace": False}}}
        t = _ask(client, CITE_QUESTION, documents, **kw).model_extra["tokrag"]
        assert t["trace"] is None
        fact = _cited_fact(t["citations"])
        assert any(c["passage"] == holder and c["source"] == "history.md" for c in fact)
        assert all(c["metadata"] == docs[c["passage"]].metadata for c in fact)
        sources = t["sources"]
        assert sources[0]["rank"] == holder and sources[0]["metadata"]["source"] == "history.md"
        shares = [s["contribution"] for s in sources]
        assert shares == sorted(shares, reverse=True) and sum(shares) == pytest.approx(1.0)
        if holder == 0:
            continue  # one stream is enough
        chunks = list(_ask(client, CITE_QUESTION, documents, stream=True, **kw))
        last = [c for c in chunks if c.choices][-1].model_extra["tokrag"]
        assert [(c["start"], c["end"], c["passage"]) for c in last["citations"]] == [
            (c["start"], c["end"], c["passage"]) for c in t["citations"]
        ]
        assert [s["rank"] for s in last["sources"]] == [s["rank"] for s in sources]


def test_citations_false_gives_none(server):
    r = _ask(server.client(), CITE_QUESTION, [ON_TOPIC.text, WITH_FACT.text], max_tokens=4,
             extra_body={"tokrag": {"citations": False}})
    t = r.model_extra["tokrag"]
    assert t["citations"] == [] and t["trace"]["steps"]
    assert all(not s["citation"] for s in t["trace"]["steps"])
    assert [(s["rank"], s["contribution"]) for s in t["sources"]] == [(0, None), (1, None)]


# ============================================================================ bad requests
def _raw(server, body, headers=None, content=None):
    kw = {"content": content} if content is not None else {"json": body}
    return httpx.post(f"{server.url}/v1/chat/completions", headers=headers or {}, timeout=60, **kw)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 100_000}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
        ({"temperature": "0"}, "temperature"),
        ({"n": 9}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": 3}, "stop"),
        ({"documents": "one passage"}, "documents"),
        ({"documents": [3]}, "documents[0]"),
        ({"documents": [{"txt": "x"}]}, "documents[0]"),
        ({"documents": ["d"] * 33}, "documents"),
        ({"tokrag": {"policy": "nope"}}, "tokrag.policy"),
        ({"tokrag": {"policy": 3}}, "tokrag.policy"),
        ({"tokrag": {"polcy": "rag"}}, "tokrag"),
        ({"tokrag": {"policy_options": {"no_such_option": 1}}}, "tokrag.policy_options"),
        ({"tokrag": {"filters": {"a": "b"}}}, "tokrag"),
        ({"tokrag": {"citations": "yes"}}, "tokrag.citations"),
        ({"model": 7}, "model"),
    ],
)
def test_bad_requests_get_a_400_json_error(server, change, param):
    body = {"model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 4, **change}
    r = _raw(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"] and "Traceback" not in r.text


def test_bad_requests_through_the_openai_client(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _ask(client, temperature=2.5)
    with pytest.raises(openai.BadRequestError, match="unknown policy 'nope'"):
        _ask(client, extra_body={"tokrag": {"policy": "nope"}})
    with pytest.raises(openai.BadRequestError, match="limit of 512"):
        _ask(client, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match="no_such_option"):
        _ask(client, stream=True, extra_body={"tokrag": {"policy_options": {"no_such_option": 1}}})
    assert server.health()["active"] == 0


def test_body_that_is_not_json_or_too_large(server):
    r = _raw(server, None, headers={"content-type": "application/json"}, content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = _raw(server, None, content=b"x" * 1_000_001)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = _raw(server, [1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


def test_prompt_too_long_is_a_400(server):
    r = _raw(server, {"messages": [{"role": "user", "content": "word " * 20_000}],
                      "max_tokens": 4})
    assert r.status_code == 400 and "Traceback" not in r.text


def test_temperature_zero_is_accepted(server, lm):
    r = _ask(server.client(), temperature=0)
    assert r.choices[0].message.content == _core(lm).text


# ============================================================================ limits and auth
def test_full_queue_gets_429(lm):
    live, _ = _start(lm, max_queue=1)
    first = ThreadPoolExecutor(1)
    lm.lock.acquire()  # the admitted request waits for the model, holding the only slot
    try:
        held = first.submit(_ask, live.client())
        deadline = time.monotonic() + 60
        while live.health()["active"] < 1:
            assert time.monotonic() < deadline and not held.done()
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError, match="busy"):
            _ask(live.client())
        lm.lock.release()
        assert held.result(timeout=120).choices[0].message.content == _core(lm).text
        assert live.health()["active"] == 0
    finally:
        if lm.lock._is_owned():
            lm.lock.release()
        first.shutdown()
        live.stop()


def test_auth_is_enforced_when_configured(lm, monkeypatch):
    monkeypatch.setenv("TOKRAG_API_KEY", "s3cret")
    live, _ = _start(lm)
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        with pytest.raises(openai.AuthenticationError):
            _ask(live.client(api_key="wrong"))
        r = httpx.get(f"{live.url}/v1/models", timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert live.health()["status"] == "ok"  # the probe stays open
        assert _ask(live.client(api_key="s3cret")).choices[0].message.content == _core(lm).text
    finally:
        live.stop()


def _serve_command(lm, monkeypatch, capsys, argv):
    """``tokrag serve ARGV`` through the real command line, in this process: the model it
    loads is the session's, and instead of blocking in ``uvicorn.run`` its app is served by a
    :class:`LiveServer` (returned once healthy)."""
    import uvicorn

    from tokrag_integrations import cli
    from tokrag_integrations.server import ChatService

    monkeypatch.delenv("TOKRAG_API_KEY", raising=False)
    monkeypatch.setattr(ChatService, "load", classmethod(lambda cls, config: cls(lm, config)))
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    assert cli.main(["serve", *argv]) == 0
    assert "--api-key is visible" in capsys.readouterr().err  # the flag was read
    live = LiveServer(apps[0])
    while live.health().get("status") != "ok":  # the model loads in the background
        time.sleep(0.05)
    return live


def test_serve_command_api_key_flag_is_the_servers_key(lm, monkeypatch, capsys):
    live = _serve_command(lm, monkeypatch, capsys, ["--api-key", "fl4g", "--max-new-tokens", str(MAX_TOKENS)])
    try:
        with pytest.raises(openai.AuthenticationError):
            _ask(live.client(api_key="wrong"))
        assert httpx.get(f"{live.url}/v1/models", timeout=30).status_code == 401
        assert _ask(live.client(api_key="fl4g")).choices[0].message.content == _core(lm).text
    finally:
        live.stop()


def test_serve_command_ray_api_key_flag_reaches_the_deployment(monkeypatch, capsys):
    """``tokrag serve --ray --api-key``: the deployment is given the key (the replicas'
    answers to it are in tests/integration/test_serve_ray.py, marked slow)."""
    from tokrag_integrations import cli
    from tokrag_integrations.server import ray_app

    monkeypatch.delenv("TOKRAG_API_KEY", raising=False)
    calls = []
    monkeypatch.setattr(ray_app, "run_ray", lambda config, **kw: calls.append((config, kw)))
    assert cli.main(["serve", "--ray", "--replicas", "2", "--api-key", "fl4g"]) == 0, capsys.readouterr().err
    (config, kw), = calls
    assert config.resolved_api_key() == "fl4g" and kw["replicas"] == 2


def test_health_is_503_while_the_model_loads(lm):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    release = threading.Event()

    def loader():
        release.wait(60)
        return ChatService(lm, ServeConfig())

    live = LiveServer(create_app(loader=loader))
    try:
        r = httpx.get(f"{live.url}/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "loading"
        with pytest.raises(openai.InternalServerError, match="loading"):
            _ask(live.client())
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{live.url}/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        live.stop()


# ============================================================================ framework clients
def test_langchain_chat_openai_against_the_server(server, lm):
    lc = require("langchain_openai", "langchain-openai")
    chat = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="default",
                         temperature=0, max_tokens=MAX_TOKENS, max_retries=0,
                         extra_body={"documents": DOCS})
    msg = chat.invoke(QUESTION)
    assert msg.content == _core(lm).text
    streamed = "".join(c.content for c in chat.stream(QUESTION))
    assert streamed == msg.content


def test_llama_index_openai_like_against_the_server(server, lm):
    mod = require("llama_index.llms.openai_like", "llama-index-llms-openai-like")
    from llama_index.core.llms import ChatMessage

    llm = mod.OpenAILike(api_base=f"{server.url}/v1", api_key="unused", model="default",
                         is_chat_model=True, temperature=0, max_tokens=MAX_TOKENS,
                         max_retries=0, additional_kwargs={"extra_body": {"documents": DOCS}})
    r = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert r.message.content == _core(lm).text
    assert r.raw.model_extra["tokrag"]["counts"] == _core(lm).trace.counts()


def test_server_default_options_apply_to_its_own_policy_only(lm):
    from tokrag_integrations.server import ChatService, Limits, ServeConfig, parse_chat_request

    svc = ChatService(lm, ServeConfig(policy="tokrag", policy_options={"pr_norm": "softmax"}))
    body = {"messages": [{"role": "user", "content": QUESTION}]}

    def settings(extra):
        return svc.settings(parse_chat_request({**body, **extra}, Limits(), svc.policies))

    assert settings({})["policy_options"]["pr_norm"] == "softmax"
    assert settings({"tokrag": {"policy_options": {"top_k": 3}}})["policy_options"]["top_k"] == 3
    assert settings({"tokrag": {"policy_options": {"top_k": 3}}})["policy_options"]["pr_norm"] == "softmax"
    assert "pr_norm" not in settings({"tokrag": {"policy": "rag"}})["policy_options"]


@pytest.mark.slow
def test_tokrag_serve_command_answers_over_http(lm, tmp_path):
    """The real command line in its own process: healthy once loaded, answers like the core,
    logs one line per request with its request id (and no uvicorn access line), serves
    /metrics without the key under ``--metrics open``, stops on Ctrl-C (slow: 36 s on a busy
    2-core machine, most of it the second process importing torch and loading the model;
    benchmarks/load_serve.py runs the same command)."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKRAG_API_KEY="k3y")
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port),
         "--max-new-tokens", str(MAX_TOKENS), "--metrics", "open"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        wait_until_healthy(proc, port, tmp_path / "serve.log")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y",
                               max_retries=0, timeout=300)
        r = client.with_options(default_headers={"x-request-id": "cli-1"}).chat.completions
        raw = r.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": QUESTION}],
            max_tokens=MAX_TOKENS, extra_body={"documents": DOCS})
        assert raw.parse().choices[0].message.content == _core(lm).text
        assert raw.headers["x-request-id"] == "cli-1"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60)
        assert metrics.status_code == 200 and "tokrag_generated_tokens_total" in metrics.text
    finally:
        interrupt(proc)
        log.close()
    assert proc.returncode in (0, 130, -signal.SIGINT)
    text = (tmp_path / "serve.log").read_text()
    assert re.search(r"INFO: +POST /v1/chat/completions 200 \d+\.\d+s request_id=cli-1\n", text), text
    assert '"POST /v1/chat/completions HTTP/1.1"' not in text  # uvicorn's access log is off
