"""``tokrag serve``'s ``/metrics`` and request ids, on the packaged model, through a real
uvicorn server; the metrics are read with ``prometheus_client``'s own text parser.

Three decodes in all (eight tokens at most each): two requests share one decode (one of them
streamed) while a third, of another policy, waits for the model."""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _helpers import LiveServer, require

require("fastapi")
require("uvicorn")
require("prometheus_client", "prometheus-client")
httpx = require("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokrag_integrations.engine import scheduler  # noqa: E402

KEY = "m3tr1cs"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOCS = ["Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø."]
CHAT = "/v1/chat/completions"


def _start(lm, **config):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    return LiveServer(create_app(ChatService(lm, ServeConfig(api_key=KEY, **config))))


@pytest.fixture(scope="module")
def server(lm):
    live = _start(lm, max_new_tokens=8)
    yield live
    live.stop()


def scrape(server, headers=AUTH):
    """``{(sample name, sorted labels): value}`` of one ``GET /metrics``."""
    r = httpx.get(f"{server.url}/metrics", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples, name, **labels):
    """The sum of the samples ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def chat(server, rid=None, **body):
    headers = {**AUTH, **({"x-request-id": rid} if rid else {})}
    body = {"messages": [{"role": "user", "content": "Who founded Quillfeather Aerospace?"}],
            "documents": DOCS, "max_tokens": 8, "stop": [], **body}
    return httpx.post(f"{server.url}{CHAT}", json=body, headers=headers, timeout=300)


def stream(server, rid=None, **body):
    """A streamed chat: ``(response headers, the usage chunk, the last tokrag object)``."""
    import json

    headers = {**AUTH, **({"x-request-id": rid} if rid else {})}
    body = {"messages": [{"role": "user", "content": "Who founded Quillfeather Aerospace?"}],
            "documents": DOCS, "max_tokens": 8, "stop": [], "stream": True,
            "stream_options": {"include_usage": True}, **body}
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, headers=headers,
                      timeout=300) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    tokrag = [e["tokrag"] for e in events if "counts" in e.get("tokrag", {})]
    return r.headers, events[-1]["usage"], tokrag[-1]


def test_metrics_move_under_load(server, lm, monkeypatch, caplog):
    """While a tokrag decode is held after its first step, a streamed request with the same
    settings and a rag request wait: the gauges show them; once released, every answer is
    counted (requests by route and status, tokens, tokens by source per policy, latencies)."""
    caplog.set_level(logging.INFO, logger="tokrag.serve")
    before = scrape(server)
    stepped, go = threading.Event(), threading.Event()
    real_step = scheduler._Loop._step

    def held_step(loop):
        real_step(loop)
        stepped.set()
        assert go.wait(120)

    monkeypatch.setattr(scheduler._Loop, "_step", held_step)
    with ThreadPoolExecutor(3) as pool:
        try:
            first = pool.submit(chat, server, "load-1")
            assert stepped.wait(120)  # decoding, two rows, and held
            joining = pool.submit(stream, server, "load-2")
            other = pool.submit(chat, server, "load-3", tokrag={"policy": "rag"})
            deadline = time.monotonic() + 120
            while value(during := scrape(server), "tokrag_requests_waiting") < 2:
                assert time.monotonic() < deadline, during
                time.sleep(0.05)
        finally:
            go.set()
            monkeypatch.setattr(scheduler._Loop, "_step", real_step)
        answers = [first.result().json(), other.result().json()]
        stream_headers, stream_usage, stream_tokrag = joining.result()
    assert value(during, "tokrag_requests_active") == 3
    assert value(during, "tokrag_running_rows") == 2  # the held tokrag request: two contexts

    after = scrape(server)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert value(d, "tokrag_requests_total", route=CHAT, code="200") == 3
    assert value(after, "tokrag_requests_active") == value(after, "tokrag_requests_waiting") == 0
    assert value(after, "tokrag_running_rows") == 0
    usages = [a["usage"] for a in answers] + [stream_usage]
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated > 0 and value(d, "tokrag_generated_tokens_total") == generated
    assert value(d, "tokrag_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    by_source = {}
    for t in [a["tokrag"] for a in answers] + [stream_tokrag]:
        for source, n in t["counts"].items():
            by_source[t["policy"], source] = by_source.get((t["policy"], source), 0) + n
    assert {p for p, _ in by_source} == {"tokrag", "rag"}
    for (policy, source), n in by_source.items():
        assert value(d, "tokrag_generated_tokens_by_source_total", policy=policy,
                     source=source) == n
    assert value(d, "tokrag_generated_tokens_by_source_total") == generated
    assert value(d, "tokrag_e2e_request_latency_seconds_count") == 3
    assert value(d, "tokrag_e2e_request_latency_seconds_sum") > 0
    assert value(d, "tokrag_time_to_first_token_seconds_count") == 1  # the stream's
    assert value(d, "tokrag_e2e_request_latency_seconds_bucket", le="+Inf") == 3

    # The request ids came back, on the plain answers and the stream, and are in the log.
    assert stream_headers["x-request-id"] == "load-2"
    lines = [r.getMessage() for r in caplog.records if r.name == "tokrag.serve"]
    for rid in ("load-1", "load-2", "load-3"):
        (line,) = [x for x in lines if x.endswith(f"request_id={rid}")]
        assert re.fullmatch(rf"POST {CHAT} 200 \d+\.\d{{3}}s request_id={rid}", line)


def test_refusals_are_counted_with_their_status_and_carry_a_request_id(server, caplog):
    caplog.set_level(logging.INFO, logger="tokrag.serve")
    before = scrape(server)
    r = chat(server, "bad-1", temperature=2.5)
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    r = httpx.post(f"{server.url}{CHAT}", json={}, timeout=60)  # no key
    assert r.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    generated = r.headers["x-request-id"]
    r = httpx.get(f"{server.url}/no/such/route", headers={"x-request-id": "x" * 129}, timeout=60)
    assert r.status_code == 404 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    r = httpx.get(f"{server.url}/health", headers={"x-request-id": "has space"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] != "has space"
    assert r.headers["x-tokrag-replica"] == r.json()["replica"]
    d = scrape(server)
    assert value(d, "tokrag_requests_total", route=CHAT, code="400") == value(
        before, "tokrag_requests_total", route=CHAT, code="400") + 1
    assert value(d, "tokrag_requests_total", route=CHAT, code="401") == value(
        before, "tokrag_requests_total", route=CHAT, code="401") + 1
    assert value(d, "tokrag_requests_total", route="other", code="404") >= 1
    assert value(d, "tokrag_e2e_request_latency_seconds_count") == value(
        before, "tokrag_e2e_request_latency_seconds_count")  # refusals are no answers
    lines = [r.getMessage() for r in caplog.records if r.name == "tokrag.serve"]
    assert f"POST {CHAT} 400" in next(x for x in lines if x.endswith("request_id=bad-1"))
    assert f"POST {CHAT} 401" in next(x for x in lines if x.endswith(f"request_id={generated}"))


def test_a_stream_without_an_id_gets_one(server, caplog):
    caplog.set_level(logging.INFO, logger="tokrag.serve")
    headers, usage, _ = stream(server, max_tokens=2)
    rid = headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and usage["completion_tokens"] >= 1
    # the app logs once the response has ended, which may be after the client read its end
    deadline = time.monotonic() + 30
    while not any(r.getMessage().endswith(f"request_id={rid}") for r in caplog.records):
        assert time.monotonic() < deadline, "no log line for the stream's request id"
        time.sleep(0.05)


def test_an_unexpected_error_is_a_500_with_a_request_id_and_counted(server, monkeypatch):
    from tokrag_integrations.server import ChatService

    def broken(self, req):
        raise RuntimeError("boom")

    before = scrape(server)
    monkeypatch.setattr(ChatService, "passages", broken)
    r = chat(server, "err-1")
    assert r.status_code == 500 and r.headers["x-request-id"] == "err-1"
    assert r.json()["error"]["type"] == "server_error" and "boom" not in r.text
    assert value(scrape(server), "tokrag_requests_total", route=CHAT, code="500") == value(
        before, "tokrag_requests_total", route=CHAT, code="500") + 1


def test_metrics_need_the_key_as_the_other_routes(server):
    r = httpx.get(f"{server.url}/metrics", timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert value(scrape(server), "tokrag_requests_total", route="/metrics", code="401") >= 1


def test_metrics_in_openmetrics_when_asked_as_prometheus_does(server):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse

    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    r = httpx.get(f"{server.url}/metrics", headers={**AUTH, "Accept": accept}, timeout=60)
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    names = {f.name for f in parse(r.text)}
    assert {"tokrag_requests", "tokrag_running_rows", "tokrag_e2e_request_latency_seconds"} <= names


def test_metrics_open_or_off(lm):
    live = _start(lm, metrics="open")
    try:
        assert value(scrape(live, headers={}), "tokrag_requests_active") == 0  # no key needed
        assert httpx.get(f"{live.url}/v1/models", timeout=60).status_code == 401  # still keyed
    finally:
        live.stop()
    live = _start(lm, metrics="off")
    try:
        assert httpx.get(f"{live.url}/metrics", headers=AUTH, timeout=60).status_code == 404
    finally:
        live.stop()
    with pytest.raises(ValueError, match="metrics must be one of key, open, off"):
        _start(lm, metrics="on")
