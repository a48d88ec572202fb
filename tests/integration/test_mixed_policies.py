"""Concurrent calls with different policies and options on one model: the micro-batcher keeps
them apart by their settings (``MicroBatcher._key``), so each call gets exactly its solo answer
and its trace names its own policy and options.

Two entry points: the batching functions called from threads at once (plain calls and a
stream), and ``tokrag serve`` over real HTTP with concurrent clients. The solo answers come from
the core API with batching off. The requests share one question and its passages, so a call
decoded under another call's settings would give another answer, count or trace."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from _helpers import LiveServer

from tokrag_integrations.defaults import ANSWER_STOP
from tokrag_integrations.engine import scheduler as batching

DOCS = [
    "Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø, Norway.",
    "The company builds reusable sounding rockets for atmospheric research.",
]
QUESTION = "Who founded Quillfeather Aerospace?"
OTHER = "Where was Quillfeather Aerospace founded?"
N_TOKENS = 8

#: (question, policy, policy options, max new tokens, streamed): two calls per policy where a
#: batch can form (tokrag, rag), an option and a token budget that differ from the default
#: tokrag call's, and a stream among them.
REQUESTS: list[tuple[str, str, dict[str, Any] | None, int, bool]] = [
    (QUESTION, "tokrag", None, N_TOKENS, False),
    (OTHER, "tokrag", None, N_TOKENS, False),
    (QUESTION, "tokrag", {"threshold": 0.5}, N_TOKENS, False),
    (QUESTION, "tokrag", None, N_TOKENS - 3, False),
    (QUESTION, "rag", None, N_TOKENS, False),
    (OTHER, "rag", None, N_TOKENS, False),
    (QUESTION, "no_rag", None, N_TOKENS, False),
    (QUESTION, "cad", None, N_TOKENS, False),
    (QUESTION, "no_rag", None, N_TOKENS, True),
    (OTHER, "tokrag", {"threshold": 0.5}, N_TOKENS, True),
]


def _summary(policy: str, options: dict[str, Any], text: str, steps: list[Any]) -> dict[str, Any]:
    return {"policy": policy, "options": options, "text": text, "sources": steps}


def _of_result(r: Any) -> dict[str, Any]:
    return _summary(r.trace.policy, r.trace.options, r.text, [s.source for s in r.trace.steps])


@pytest.fixture(scope="module")
def solo(lm) -> list[dict[str, Any]]:
    """Each request decoded alone (batching off), with the server's stop strings."""
    return [
        _of_result(batching.generate(lm, q, DOCS, policy=p, policy_options=o, max_new_tokens=n,
                                     stop=list(ANSWER_STOP), batching=False))
        for q, p, o, n, _ in REQUESTS
    ]


def test_the_requests_differ_alone(solo):
    """The guard's premise: mixed into one another's settings, the answers would change."""
    assert len({s["text"] for s in solo}) >= 4
    assert len({(s["policy"], repr(s["options"])) for s in solo}) >= 5


def test_threads_with_mixed_policies_each_get_their_solo_answer(lm, solo):
    b = batching.batcher_for(lm)
    before = b.batched_calls
    start = threading.Barrier(len(REQUESTS))

    def call(i: int) -> dict[str, Any]:
        q, p, o, n, streamed = REQUESTS[i]
        kw = {"policy": p, "policy_options": o, "max_new_tokens": n, "stop": list(ANSWER_STOP),
              "batching": True}
        start.wait()
        if not streamed:
            return _of_result(batching.generate(lm, q, DOCS, **kw))
        s = batching.stream(lm, q, DOCS, **kw)
        events = list(s)
        out = _of_result(s.result)
        assert "".join(e.text for e in events) == out["text"]
        assert [e.source for e in events] == out["sources"]
        return out

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(call, range(len(REQUESTS))))
    for i, (got, want) in enumerate(zip(together, solo, strict=True)):
        assert got == want, f"request {i} {REQUESTS[i]}"
    assert b.batched_calls >= before + 2, "no two calls shared a decode"


def _post(url: str, question: str, policy: str, options: dict[str, Any] | None, n: int,
          streamed: bool) -> dict[str, Any]:
    tokrag: dict[str, Any] = {"policy": policy}
    if options is not None:
        tokrag["policy_options"] = options
    body = {"model": "default", "messages": [{"role": "user", "content": question}],
            "documents": DOCS, "max_tokens": n, "temperature": 0, "stream": streamed,
            "tokrag": tokrag}
    if not streamed:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        t = r.json()["tokrag"]
        return _summary(t["policy"], t["trace"]["options"], r.json()["choices"][0]["message"]["content"],
                        [s["source"] for s in t["trace"]["steps"]])
    text, last = "", None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                text += chunk["choices"][0]["delta"].get("content") or ""
                if chunk["choices"][0]["finish_reason"]:
                    last = chunk["tokrag"]
    assert last is not None, "the stream ended without its final chunk"
    return _summary(last["policy"], last["trace"]["options"], text,
                    [s["source"] for s in last["trace"]["steps"]])


def test_server_with_mixed_policies_answers_each_as_alone(lm, solo):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    service = ChatService(lm, ServeConfig(max_new_tokens=N_TOKENS))
    live = LiveServer(create_app(service))
    try:
        before = service.batcher.batched_calls
        with ThreadPoolExecutor(len(REQUESTS)) as pool:
            together = list(pool.map(lambda r: _post(live.url, *r), REQUESTS))
        for i, (got, want) in enumerate(zip(together, solo, strict=True)):
            assert got == want, f"request {i} {REQUESTS[i]}"
        assert service.batcher.batched_calls >= before + 2, "no two requests shared a decode"
        assert live.health()["active"] == 0
    finally:
        live.stop()
