"""Issue 54 (remote clients): ``RemoteModel`` (what ``TokRAGLLM(base_url=)`` and
``ChatTokRAG(base_url=)`` decode with) against hostile HTTP servers in this process: raw
sockets that trickle a status line or a body a byte at a time, send endless bodies and
event streams, huge or compressed answers, redirects, retry waits past the deadline, and
answers that are not the server's format. Each call runs in a thread checked from outside
with a generous bound (never a timed assert); it must end, with the right error.

Also the server's request log against a hostile path (a real ``tokrag serve`` app).
Checks that need no server are in ``tests/unit/test_security_remote.py``."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import LiveServer, require

require("openai")
httpx = require("httpx")

from tokrag_integrations.langchain import ChatTokRAG  # noqa: E402
from tokrag_integrations.llama_index import TokRAGLLM  # noqa: E402
from tokrag_integrations.server.client import RemoteError, RemoteModel  # noqa: E402

TIMEOUT = 2.0  # the client's timeout= in these tests
BOUND = 30.0  # seconds a call may take, seen from outside, before the test calls it hung
MODELS = json.dumps(
    {
        "object": "list",
        "data": [
            {"id": "m", "object": "model", "created": 0, "owned_by": "t", "context_window": 2048,
             "chat": True, "eos_token_ids": [2]}
        ],
    }
).encode()  # fmt: skip


class Hostile:
    """A raw HTTP server in a thread: ``GET .../models`` is answered properly (the async
    calls ask it first), every other request is handed to ``behave(server, writer, head)``.
    ``sent``: bytes written to clients; ``requests``: (request line, headers, body)."""

    def __init__(self, behave: Callable[[Hostile, Any, dict], None], models: bytes = MODELS):
        self.behave, self.stop, self.sent, self.requests = behave, threading.Event(), 0, []
        self.models = models
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline().decode("latin-1")
                headers = {}
                while (h := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode("latin-1").partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = self.rfile.read(int(headers.get("content-length") or 0))
                outer.requests.append((line, headers, body))
                try:
                    if line.startswith("GET") and "/models" in line:
                        outer.answer(self.wfile, 200, outer.models)
                    else:
                        outer.behave(outer, self.wfile, headers)
                except OSError:  # the client hung up: what the guards do
                    pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def send(self, w: Any, data: bytes) -> None:
        w.write(data)
        w.flush()
        self.sent += len(data)

    def answer(self, w: Any, status: int, body: bytes, *headers: str) -> None:
        head = [f"HTTP/1.1 {status} X", "content-type: application/json", *headers,
                f"content-length: {len(body)}", "connection: close"]  # fmt: skip
        self.send(w, ("\r\n".join(head) + "\r\n\r\n").encode() + body)

    def trickle(self, w: Any, data: bytes, every: float = 0.5) -> None:
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            self.send(w, data[i : i + 1])

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hostile():
    made: list[Hostile] = []

    def make(behave, **kw):
        made.append(Hostile(behave, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _outcome(call: Callable[[], Any]) -> BaseException | Any:
    """Run ``call`` in a thread; what it raised (or returned) once it ended. A call still
    running after :data:`BOUND` seconds fails the test."""
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND)
    assert not thread.is_alive(), f"the call was still running after {BOUND:g} s"
    return got[0]


def _calls(model: RemoteModel) -> dict[str, Callable[[], Any]]:
    """The four ways to call a server, each finished (streams read to their end)."""

    async def astream() -> list[Any]:
        return [x async for x in model.astream_with_result("Q?", ["d"], max_new_tokens=4)]

    return {
        "generate": lambda: model.generate("Q?", ["d"], max_new_tokens=4),
        "agenerate": lambda: asyncio.run(model.agenerate("Q?", ["d"], max_new_tokens=4)),
        "stream": lambda: list(model.stream("Q?", ["d"], max_new_tokens=4)),
        "astream": lambda: asyncio.run(astream()),
    }


# ------------------------------------------------------------------ misbehaving servers
STATUS = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 10\r\n\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n"
ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'


def trickled_status_line(s: Hostile, w: Any, head: dict) -> None:
    s.trickle(w, STATUS * 20)


def endless_body(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{")
    while not s.stop.wait(0.01):  # ~100 KB/s: the deadline ends it, not the size cap
        s.send(w, b" " * 1024)


def trickled_body(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 999\r\n\r\n")
    s.trickle(w, b"{" + b" " * 998)


def endless_event_stream(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, SSE_HEAD + ROLE)
    while not s.stop.wait(0.05):  # events that carry no token, and keep-alive comments
        s.send(w, ROLE + b": ping\n\n")


def trickled_event(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, SSE_HEAD)
    s.trickle(w, ROLE * 10)


DEADLINE_CASES = [
    (trickled_status_line, "generate"),
    (trickled_status_line, "agenerate"),
    (trickled_status_line, "stream"),
    (trickled_status_line, "astream"),
    (endless_body, "generate"),
    (endless_body, "agenerate"),
    (trickled_body, "generate"),
    (trickled_body, "agenerate"),
    (endless_event_stream, "stream"),
    (endless_event_stream, "astream"),
    (trickled_event, "stream"),
    (trickled_event, "astream"),
]


@pytest.mark.parametrize(
    "behave, how", DEADLINE_CASES, ids=[f"{b.__name__}-{h}" for b, h in DEADLINE_CASES]
)
def test_02_05_timeout_bounds_the_whole_call_whatever_the_server_does(hostile, behave, how):
    """Medium 2-5: every byte arrives within httpx's per-read timeout, so only a deadline for
    the whole call ends these."""
    server = hostile(behave)
    model = RemoteModel(server.url, timeout=TIMEOUT, max_retries=2)
    got = _outcome(_calls(model)[how])
    assert isinstance(got, TimeoutError), repr(got)
    assert str(got) == f"the tokrag server at {server.url} did not answer within timeout=2 s"
    if behave is not trickled_status_line:
        assert len([r for r in server.requests if r[0].startswith("POST")]) == 1  # no retry


def test_02_the_adapters_pass_their_timeout_to_the_deadline(hostile):
    server = hostile(trickled_status_line)
    llm = TokRAGLLM(base_url=server.url, timeout=TIMEOUT, max_retries=0)
    got = _outcome(lambda: llm.complete("Q?", passages=["d"]))
    assert isinstance(got, TimeoutError), repr(got)
    chat = ChatTokRAG(base_url=server.url, timeout=TIMEOUT, max_retries=0)
    got = _outcome(lambda: list(chat.stream("Q?", passages=["d"])))
    assert isinstance(got, TimeoutError), repr(got)


def _busy(after: str) -> Callable[[Hostile, Any, dict], None]:
    def busy(s: Hostile, w: Any, head: dict) -> None:
        s.answer(w, 503, b'{"error": {"message": "busy"}}', f"retry-after: {after}")

    return busy


def test_retries_and_their_waits_stay_within_the_deadline(hostile):
    """A Retry-After that ends past the deadline is not waited for (the openai client would
    sleep it, up to two minutes a retry)."""
    server = hostile(_busy("30"))
    got = _outcome(_calls(RemoteModel(server.url, timeout=TIMEOUT, max_retries=3))["generate"])
    assert isinstance(got, RemoteError) and got.status == 503, repr(got)
    assert "answered 503 (after 0 retries): busy" in str(got)
    assert len(server.requests) == 1
    quick = hostile(_busy("0.1"))  # a short wait is honoured: every retry made
    got = _outcome(_calls(RemoteModel(quick.url, timeout=20, max_retries=2))["generate"])
    assert isinstance(got, RemoteError) and "(after 2 retries)" in str(got), repr(got)
    assert len(quick.requests) == 3


# ------------------------------------------------------------------ size cap
def huge_body(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
    while not s.stop.is_set():
        s.send(w, b" " * 65536)


def huge_stream(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, SSE_HEAD)
    while not s.stop.is_set():
        s.send(w, ROLE * 500)


def announced_600_mb(s: Hostile, w: Any, head: dict) -> None:
    s.send(w, b"HTTP/1.1 200 OK\r\ncontent-length: 629145600\r\n\r\n")
    while not s.stop.is_set():
        s.send(w, b" " * 65536)


@pytest.mark.parametrize("behave", [huge_body, huge_stream, announced_600_mb])
@pytest.mark.parametrize("how", ["generate", "agenerate", "stream", "astream"])
def test_06_an_answer_larger_than_the_cap_is_refused_and_not_read(hostile, behave, how):
    server = hostile(behave)
    model = RemoteModel(server.url, timeout=60, max_response_mb=1)
    got = _outcome(_calls(model)[how])
    assert isinstance(got, RemoteError), repr(got)
    assert str(got).startswith(f"the tokrag server at {server.url} sent an answer that ")
    assert "max_response_mb=1 (1048576 bytes)" in str(got)
    # The read stopped at the cap: what the server got out is the cap plus socket buffers.
    assert server.sent < 64 * 2**20
    assert len([r for r in server.requests if r[0].startswith("POST")]) == 1


def test_06_the_cap_is_an_option_of_the_adapters(hostile):
    server = hostile(huge_body)
    chat = ChatTokRAG(base_url=server.url, max_response_mb=0.5)
    got = _outcome(lambda: chat.invoke("Q?", passages=["d"]))
    assert isinstance(got, RemoteError) and "max_response_mb=0.5 (524288 bytes)" in str(got)
    with pytest.raises(ValueError, match="max_response_mb must be a number above 0"):
        TokRAGLLM(base_url=server.url, max_response_mb=0)


def gzip_bomb(s: Hostile, w: Any, head: dict) -> None:
    bomb = gzip.compress(b" " * (50 * 2**20))  # 50 MB of spaces in about 50 KB
    s.answer(w, 200, bomb, "content-encoding: gzip")


def test_06_no_compression_is_asked_for_and_a_compressed_answer_is_refused(hostile):
    server = hostile(gzip_bomb)
    got = _outcome(_calls(RemoteModel(server.url, timeout=60, max_response_mb=1))["generate"])
    assert isinstance(got, RemoteError), repr(got)
    assert "is compressed (Content-Encoding: 'gzip'), which the client did not ask" in str(got)
    assert server.requests[0][1]["accept-encoding"] == "identity"


# ------------------------------------------------------------------ redirects
def test_a_redirect_is_not_followed_and_names_its_location(hostile):
    """The probe saw a 307 re-send the POST body (question and documents) to another host."""
    elsewhere = hostile(lambda s, w, head: s.answer(w, 200, b"{}"))
    target = elsewhere.url.replace("http://", "http://eve:pw@") + "/chat/completions"

    def redirect(s: Hostile, w: Any, head: dict) -> None:
        s.answer(w, 307, b"", f"location: {target}")

    server = hostile(redirect)
    model = RemoteModel(server.url, timeout=20)
    for how in ("generate", "agenerate", "stream", "astream"):
        got = _outcome(_calls(model)[how])
        assert isinstance(got, RemoteError) and got.status == 307, repr(got)
        assert "redirected the request (307) to 'http://***@127.0.0.1:" in str(got)
        assert "follows no redirect" in str(got) and "pw" not in str(got)
    assert elsewhere.requests == []  # nothing, above all not the body, went there


# ------------------------------------------------------------------ answers not the server's
def _trace(**change: Any) -> dict:
    step = {"index": 0, "token_id": 7, "text": "Ada", "source": "rag", "citation": [1.0]}
    return {"query": "Q?", "policy": "tokrag", "steps": [step],
            "passages": [{"rank": 0, "text": "d"}], **change}  # fmt: skip


def _completion(tokrag: Any = None, **top: Any) -> bytes:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Ada"},
                         "finish_reason": "stop"}], **top}  # fmt: skip
    if tokrag is not None:
        body["tokrag"] = tokrag
    return json.dumps(body).encode()


CITED_50003 = _trace(
    steps=[{"index": 0, "token_id": 7, "text": "Ada", "source": "rag", "citation": [0.0] * 50003}]
)
MALFORMED = {
    "truncated JSON": (_completion({"trace": _trace()})[:-9], "is not JSON (it starts"),
    "HTML": (b"<html><body>502 Bad Gateway</body></html>", "is not JSON (it starts '<html>"),
    "empty object": (b"{}", "has no 'choices'"),
    "no tokrag key": (_completion(), "has no 'tokrag' object"),
    "no trace": (_completion({"policy": "tokrag"}), "has no 'tokrag.trace' object"),
    "trace of the wrong shape": (
        _completion({"trace": _trace(steps="abc")}),
        "holds a malformed trace (trace.steps is a str, not a list)",
    ),
    "step without token_id": (
        _completion({"trace": _trace(steps=[{"index": 0, "text": "a", "source": "rag"}])}),
        "holds a malformed trace (trace.steps[0] has no 'token_id')",
    ),
    "citation naming 50,003 passages": (
        _completion({"trace": CITED_50003}),
        "trace.steps[0].citation has 50003 shares, not one per kept passage (1)",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_an_answer_not_in_the_servers_format_is_one_sentence_at_parse_time(hostile, case):
    body, what = MALFORMED[case]
    server = hostile(lambda s, w, head: s.answer(w, 200, body))
    for how in ("generate", "agenerate"):
        got = _outcome(_calls(RemoteModel(server.url, timeout=20))[how])
        assert isinstance(got, RemoteError), repr(got)
        assert str(got).startswith(f"the tokrag server at {server.url} sent an answer that ")
        assert what in str(got) and str(got).count("\n") == 0


def test_a_well_formed_answer_still_parses(hostile):
    """The checks refuse what is malformed only: the smallest valid answer is a result."""
    server = hostile(lambda s, w, head: s.answer(w, 200, _completion({"trace": _trace()})))
    got = _outcome(_calls(RemoteModel(server.url, timeout=20))["generate"])
    assert got.text == "Ada" and got.token_ids == [7]
    assert got.trace.cite(0, 1) == (0, 1.0) and got.trace.to_html()


def _events(*events: bytes) -> Callable[[Hostile, Any, dict], None]:
    def send(s: Hostile, w: Any, head: dict) -> None:
        s.send(w, SSE_HEAD + ROLE + b"".join(b"data: " + e + b"\n\n" for e in events))

    return send


def _token(i: int) -> bytes:
    return json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}],
         "tokrag": {"token_id": i, "source": "rag"}}
    ).encode()  # fmt: skip


FINAL = json.dumps(
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
     "tokrag": {"trace": CITED_50003}}
).encode()  # fmt: skip
MALFORMED_STREAMS = {
    "event not JSON": ((b"{oops",), "holds an event that is not JSON"),
    "event a list": ((b"[1, 2]",), "holds an event that is not a chat completion chunk"),
    "token event without token_id": (
        (b'{"choices": [{"delta": {"content": "a"}}], "tokrag": {"source": "rag"}}',),
        "holds a token event without its text, 'token_id' and 'source'",
    ),
    "more tokens than max_tokens": (
        tuple(_token(i) for i in range(50)),
        "streams more tokens than the max_tokens=4 asked",
    ),
    "ends before its last event": ((_token(1), b"[DONE]"), "ended after 1 token(s), before"),
    "last event with a malformed trace": ((_token(1), FINAL), "citation has 50003 shares"),
}


@pytest.mark.parametrize("case", list(MALFORMED_STREAMS))
def test_a_stream_not_in_the_servers_format_is_one_sentence(hostile, case):
    events, what = MALFORMED_STREAMS[case]
    server = hostile(_events(*events))
    for how in ("stream", "astream"):
        got = _outcome(_calls(RemoteModel(server.url, timeout=20))[how])
        assert isinstance(got, RemoteError), repr(got)
        assert str(got).startswith(f"the tokrag server at {server.url} sent an answer that ")
        assert what in str(got)


def test_models_list_not_in_the_servers_format_is_one_sentence(hostile):
    odd = json.dumps({"data": [{"id": "m", "context_window": "big"}]}).encode()
    server = hostile(lambda s, w, head: None, models=odd)
    got = _outcome(lambda: RemoteModel(server.url, timeout=20).context_window)
    assert isinstance(got, RemoteError), repr(got)
    assert "sent an answer that gives 'context_window' big, not a positive integer" in str(got)


# ------------------------------------------------------------------ the server's request log
def test_a_hostile_path_cannot_forge_a_request_log_line(caplog):
    """A path with encoded spaces and a line break (decoded by the server) is logged
    percent-encoded: one line, whose fields are the real request's."""
    from tokrag_integrations.server import create_app

    def never_loads():
        raise RuntimeError("no model in this test")

    live = LiveServer(create_app(loader=never_loads))
    caplog.set_level(logging.INFO, logger="tokrag.serve")
    forged = "/x%20200%200.001s%20request_id=forged%0AGET%20/v1/models%20200"
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
            sock.sendall(
                f"GET {forged} HTTP/1.1\r\nhost: x\r\nx-request-id: real-7\r\n"
                "connection: close\r\n\r\n".encode()
            )
            while sock.recv(65536):
                pass
    finally:
        live.stop()
    (line,) = [r.getMessage() for r in caplog.records if "real-7" in r.getMessage()]
    assert line.startswith(
        "GET /x%20200%200.001s%20request_id=forged%0AGET%20/v1/models%20200 404 "
    )
    assert line.endswith(" request_id=real-7") and "\n" not in line and line.count(" ") == 4
