"""``RemoteModel``: the core's ``generate`` / ``stream`` / ``agenerate`` / ``astream_with_result``
decoded on a ``tokrag serve`` server instead of a local model, returning the same
:class:`~tokrag_integrations.GenerationResult` (trace included) and
:class:`~tokrag_integrations.TokenEvent` objects. ``TokRAGLLM(base_url=...)`` and
``ChatTokRAG(base_url=...)`` swap it in for their ``LoadedModel``.

The HTTP side is the ``openai`` client (the ``remote`` extra) over ``httpx``: requests,
server-sent events, error bodies, sync and async. The request carries the core call's
arguments: ``messages`` = system prompt + history + question, ``documents`` = the passages,
``tokrag`` = policy, options, prompt format, context budget, citations and a
template-formatted prompt (``rendered``).

What this module adds to that client, because a server may be slow, broken or hostile
(docs/security.md, "Remote clients"):

- **One deadline per call.** httpx's timeouts bound each read and write, so a server that
  sends a byte every few seconds (or an endless body or stream) keeps a request alive for
  ever. Here ``timeout`` bounds the whole call: connecting, sending, every retry and its
  wait, the whole answer or the whole stream. Async calls run under ``anyio.fail_after``
  (cancellation); sync calls get a watchdog timer that shuts the request's socket down at
  the deadline (httpx has no way to cancel a blocking read from another thread; the socket
  comes from httpcore's documented ``trace`` extension). The retries are made here, not by
  the ``openai`` client, whose waits (``Retry-After`` up to two minutes) no deadline bounds.
- **A cap on an answer's size** (``max_response_mb``): the body is counted as it arrives and
  the read stops at the cap; the client asks for no compression and refuses a compressed
  answer (a small gzip body can unpack to gigabytes).
- **No redirects**: a POST body holds the question and the documents; a 3xx is an error
  naming its ``Location``, never followed.
- **No credentials in the URL**: ``user:password@`` in ``base_url`` is refused (the server's
  key is ``api_key=``) and never echoed.
- **Strict answers**: a body that is not the server's format is one sentence naming the
  server, at parse time (the trace's shape is checked by :meth:`Trace.from_dict`).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import math
import random
import re
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import suppress
from typing import Any

from .. import config
from ..defaults import REMOTE_MAX_RESPONSE_MB
from ..prompts import as_passages
from ..results import GenerationResult, TokenEvent
from ..trace import Trace, TraceStep, json_data

__all__ = ["MAX_RESPONSE_MB", "RemoteError", "RemoteModel"]

#: The core's keyword arguments a server request carries.
_CALL_KEYS = (
    "policy",
    "policy_options",
    "max_new_tokens",
    "stop",
    "messages",
    "system_prompt",
    "max_context_tokens",
    "prompt_format",
    "rendered",
    "citations",
)

#: Default ``max_response_mb`` (:data:`..defaults.REMOTE_MAX_RESPONSE_MB`).
MAX_RESPONSE_MB = REMOTE_MAX_RESPONSE_MB
#: The largest ``timeout`` (seconds, about 115 days): what a timer and a socket can wait.
MAX_TIMEOUT = 1e7
#: The longest ``Retry-After`` (seconds) honoured; a longer one is not retried.
MAX_RETRY_AFTER = 60.0
#: Exponential backoff between retries without ``Retry-After``: first wait and largest wait.
_BACKOFF = (0.5, 8.0)
#: Statuses retried (as the ``openai`` client does): timeouts, conflicts, rate limits, 5xx.
_RETRIED = frozenset({408, 409, 429})

#: ``user:password@`` (or ``user@``) in a URL's authority, with or without a scheme.
_USERINFO = re.compile(r"^((?:[^:/?#]*:)?//)?[^/?#]*@")


class RemoteError(RuntimeError):
    """The server failed to answer (``status``: its HTTP status, None without a response)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Refused(Exception):
    """The client stopped reading an answer; ``reason`` completes "sent an answer that ..."."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Malformed(ValueError):
    """An answer that is not the server's format; the message says what is wrong."""


def redacted(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@`` (for messages)."""
    return _USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", url, count=1)


class _Call:
    """One call's deadline (``time.monotonic()``) and, for sync calls, its watchdog: a timer
    that at the deadline marks the call ``fired`` and shuts down the socket of the request
    under way (a blocked read then ends at once)."""

    def __init__(self, seconds: float, watch: bool) -> None:
        self.deadline = time.monotonic() + seconds
        self.fired = False
        self._lock = threading.Lock()
        self._sock: Any = None
        self._timer: threading.Timer | None = None
        if watch:
            self._timer = threading.Timer(seconds, self._fire)
            self._timer.daemon = True
            self._timer.start()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.fired or self.left() <= 0

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` extension: keep the socket of each connection made (and of
        its TLS layer); one made after the deadline is shut down at once."""
        get = getattr(info.get("return_value"), "get_extra_info", None)
        if not event.endswith(".complete") or get is None:
            return
        sock = get("socket")
        if sock is None:
            return
        with self._lock:
            self._sock, fired = sock, self.fired
        if fired:
            _shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired, sock = True, self._sock
        if sock is not None:
            _shutdown(sock)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._sock = None


#: The call in progress in this context (its deadline and watchdog), for the request hook.
_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("tokrag_call", default=None)


def _shutdown(sock: Any) -> None:
    # socket.socket's own shutdown, also for an SSLSocket (whose override would unwrap it
    # from this thread while the request's thread reads it).
    with suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _on_request(request: Any) -> None:
    """httpx request hook (sync client): the call's watchdog learns the request's sockets."""
    call = _CALL.get()
    if call is not None:
        request.extensions["trace"] = call.trace


def _checked_head(response: Any, max_bytes: int) -> None:
    """Refuse, before its body, an answer announced larger than the cap or compressed."""
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _Refused(f"announces {int(length)} bytes, over {_cap_text(max_bytes)}")
    coding = response.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise _Refused(
            f"is compressed (Content-Encoding: {coding[:40]!r}), which the client did not ask for"
        )


def _cap_text(max_bytes: int) -> str:
    return f"max_response_mb={max_bytes / 2**20:g} ({max_bytes} bytes)"


class _Counted:
    """Counts a body's bytes as they arrive and stops the read past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.seen = max_bytes, 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        if self.seen > self.max_bytes:
            raise _Refused(f"is larger than {_cap_text(self.max_bytes)}")


def _sync_http(openai: Any, httpx: Any, max_bytes: int) -> Any:
    """The sync client's httpx client: no redirects, no compression, no kept-alive
    connection (each request's socket is new, so the watchdog always learns it), a counted
    body."""

    class Capped(httpx.SyncByteStream):
        def __init__(self, inner: Any) -> None:
            self._inner, self._count = inner, _Counted(max_bytes)

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                self._count.add(chunk)
                yield chunk

        def close(self) -> None:
            self._inner.close()

    def on_response(response: Any) -> None:
        try:
            _checked_head(response, max_bytes)
        except _Refused:
            response.close()
            raise
        response.stream = Capped(response.stream)

    return openai.DefaultHttpxClient(
        follow_redirects=False,
        headers={"Accept-Encoding": "identity"},
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=0),
        event_hooks={"request": [_on_request], "response": [on_response]},
    )


def _async_http(openai: Any, httpx: Any, max_bytes: int) -> Any:
    """The async client's httpx client: as :func:`_sync_http`, kept-alive connections
    allowed (a cancelled request's connection is dropped by httpx)."""

    class Capped(httpx.AsyncByteStream):
        def __init__(self, inner: Any) -> None:
            self._inner, self._count = inner, _Counted(max_bytes)

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._inner:
                self._count.add(chunk)
                yield chunk

        async def aclose(self) -> None:
            await self._inner.aclose()

    async def on_response(response: Any) -> None:
        try:
            _checked_head(response, max_bytes)
        except _Refused:
            await response.aclose()
            raise
        response.stream = Capped(response.stream)

    return openai.DefaultAsyncHttpxClient(
        follow_redirects=False,
        headers={"Accept-Encoding": "identity"},
        event_hooks={"response": [on_response]},
    )


def _checked_number(value: Any, name: str, *, most: float) -> float:
    """``value`` as a float above 0 and at most ``most``, else a ValueError naming ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not 0 < number <= most:
        raise ValueError(f"{name} must be a number above 0 and at most {most:g}, got {value!r}")
    return number


class RemoteModel:
    """A ``tokrag serve`` server at ``base_url`` (``http://host:8000/v1``) in place of a
    ``LoadedModel``: :meth:`generate`, :meth:`stream`, :meth:`agenerate` and
    :meth:`astream_with_result` take the core's arguments and return its types.

    ``api_key``: the server's bearer token (default ``$TOKRAG_API_KEY``; never shown in a
    repr, message or log); ``base_url`` may not carry credentials (``user:pass@``).
    ``timeout``: seconds a whole call may take (connecting, retries and their waits, the
    whole answer or stream), after which it raises ``TimeoutError``. ``max_retries``: retries
    of a request that failed to connect or got 408 / 409 / 429 / 5xx, waiting ``Retry-After``
    (at most 60 s) when the server sends it, never past the deadline. ``max_response_mb``:
    the largest answer read (MB of 2**20 bytes); a larger one is a :class:`RemoteError`.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        max_retries: int = 2,
        max_response_mb: float = MAX_RESPONSE_MB,
    ) -> None:
        try:
            import httpx
            import openai
        except ModuleNotFoundError:
            raise ImportError(
                "base_url= needs the openai package: pip install 'tokrag-integrations[remote]'"
            ) from None
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            shown = redacted(base_url) if isinstance(base_url, str) else base_url
            raise ValueError(
                f"base_url must be an http(s) URL such as http://host:8000/v1, got {shown!r}"
            )
        if _USERINFO.match(base_url):
            raise ValueError(
                f"base_url must not hold credentials ({redacted(base_url)!r}): pass the server's "
                f"key as api_key= (or set ${config.API_KEY})"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = _checked_number(timeout, "timeout", most=MAX_TIMEOUT)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a whole number >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        self.max_response_mb = _checked_number(max_response_mb, "max_response_mb", most=2**20)
        self._max_bytes = max(1, int(self.max_response_mb * 2**20))
        key = api_key if api_key is not None else config.api_key()
        # The openai client retries nothing: the retries are made here, within the deadline.
        self._options = {
            "base_url": self.base_url,
            "api_key": key or "unused",
            "timeout": self.timeout,
            "max_retries": 0,
        }
        self._openai, self._httpx = openai, httpx
        self._client = openai.OpenAI(
            **self._options, http_client=_sync_http(openai, httpx, self._max_bytes)
        )
        # The openai package imports its resources on first use (seconds on a busy machine):
        # here, not inside a call's deadline.
        self._chat, self._models = self._client.chat.completions, self._client.models
        # One async client per event loop: an httpx pool belongs to the loop that opened it.
        self._aclients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RemoteModel(base_url={self.base_url!r})"

    # ------------------------------------------------------------------ the served model
    def info(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` describes it (asked once): ``id``,
        ``context_window``, ``chat``, ``eos_token_ids``."""
        return self._info_within(self.timeout)

    def _info_within(self, seconds: float) -> dict[str, Any]:
        """:meth:`info`, asked within ``seconds`` (an async call's deadline covers it too)."""
        if self._info is None:
            list_models = self._models.with_raw_response.list
            raw = self._run(lambda t: list_models(timeout=t), _Call(seconds, watch=True))
            self._info = self._parsed(_model_info, raw.http_response)
        return self._info

    @property
    def name(self) -> str:
        return str(self.info()["id"])

    @property
    def context_window(self) -> int:
        return int(self.info()["context_window"])

    @property
    def is_chat(self) -> bool:
        return bool(self.info()["chat"])

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.info()["eos_token_ids"])

    # ------------------------------------------------------------------ calls
    def generate(self, query: str, passages: Any = None, **kw: Any) -> GenerationResult:
        """:func:`tokrag_integrations.generate` on the server."""
        body = self._body(query, passages, kw)
        create = self._chat.with_raw_response.create
        raw = self._run(lambda t: create(timeout=t, **body))
        return self._parsed(_answer, raw.http_response)

    def stream(self, query: str, passages: Any = None, **kw: Any) -> RemoteStream:
        """:func:`tokrag_integrations.stream` on the server: token events as they arrive,
        ``.result`` after the last. The deadline (``timeout``) covers the whole stream."""
        body = self._body(query, passages, kw)
        call = _Call(self.timeout, watch=True)
        create = self._chat.create
        events = self._run(lambda t: create(stream=True, timeout=t, **body), call, keep=True)
        return RemoteStream(self, events, call, body["max_tokens"])

    async def agenerate(self, query: str, passages: Any = None, **kw: Any) -> GenerationResult:
        """:func:`tokrag_integrations.agenerate` on the server."""
        call = _Call(self.timeout, watch=False)
        await self._ainfo(call)
        body = self._body(query, passages, kw)
        client = self._async()
        raw = await self._arun(
            lambda t: client.chat.completions.with_raw_response.create(timeout=t, **body), call
        )
        return self._parsed(_answer, raw.http_response)

    async def astream_with_result(
        self, query: str, passages: Any = None, **kw: Any
    ) -> AsyncIterator[TokenEvent | GenerationResult]:
        """Every :class:`TokenEvent`, then the :class:`GenerationResult` (as the core's). The
        deadline (``timeout``) covers the whole stream."""
        import anyio

        call = _Call(self.timeout, watch=False)
        await self._ainfo(call)
        body = self._body(query, passages, kw)
        client = self._async()
        events = await self._arun(
            lambda t: client.chat.completions.create(stream=True, timeout=t, **body), call
        )
        parser = _Parser(body["max_tokens"])
        try:
            while True:
                try:
                    with anyio.fail_after(max(call.left(), 0)):
                        chunk = await events.__anext__()
                except StopAsyncIteration:
                    raise self._malformed(parser.unfinished(), None) from None
                except TimeoutError:
                    raise self._timeout() from None
                except self._openai.OpenAIError as exc:
                    raise self._error(exc, call) from None
                except (self._httpx.HTTPError, _Refused, json.JSONDecodeError) as exc:
                    raise self._error(exc, call) from None
                try:
                    item = parser.feed(chunk)
                except _Malformed as exc:
                    raise self._malformed(str(exc), None) from None
                if item is not None:
                    yield item
                if isinstance(item, GenerationResult):
                    return
        finally:
            await events.close()  # a stream left early: its connection goes back now

    # ------------------------------------------------------------------ plumbing
    def _run(self, send: Callable[[float], Any], call: _Call | None = None, keep: bool = False):
        """``send(seconds_left)`` under one deadline with the retries; ``keep``: the call's
        watchdog stays on for the stream that ``send`` opened."""
        call = call or _Call(self.timeout, watch=True)
        token = _CALL.set(call)
        try:
            for attempt in range(self.max_retries + 1):
                try:
                    answer = send(max(call.left(), 0.001))
                    if call.fired:  # the watchdog's shutdown can read as the body's end
                        raise self._timeout()
                    return answer
                except self._openai.OpenAIError as exc:
                    wait = self._retry_wait(exc, attempt, call)
                    if wait is None:
                        raise self._error(exc, call, attempt) from None
                time.sleep(wait)
            raise AssertionError("unreachable")  # the last attempt returns or raises
        except BaseException:
            call.stop()
            raise
        finally:
            _CALL.reset(token)
            if not keep:
                call.stop()

    async def _arun(self, send: Callable[[float], Any], call: _Call | None = None) -> Any:
        """:meth:`_run` for the async client: each attempt and wait is cancelled at the
        deadline (``anyio.fail_after``)."""
        import anyio

        call = call or _Call(self.timeout, watch=False)
        for attempt in range(self.max_retries + 1):
            try:
                with anyio.fail_after(max(call.left(), 0)):
                    return await send(max(call.left(), 0.001))
            except TimeoutError:
                raise self._timeout() from None
            except self._openai.OpenAIError as exc:
                wait = self._retry_wait(exc, attempt, call)
                if wait is None:
                    raise self._error(exc, call, attempt) from None
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    def _retry_wait(self, exc: Exception, attempt: int, call: _Call) -> float | None:
        """Seconds to wait before retrying after ``exc`` (None: no retry): a failed
        connection or a retried status, with attempts left, and a wait that ends before the
        deadline. ``Retry-After`` (or ``retry-after-ms``) when given and at most
        :data:`MAX_RETRY_AFTER`, else the exponential backoff."""
        o = self._openai
        if attempt >= self.max_retries or call.expired() or _refusal(exc) is not None:
            return None
        if isinstance(exc, o.APIStatusError):
            headers = exc.response.headers
            should = headers.get("x-should-retry")
            if should != "true" and (
                should == "false" or not (exc.status_code in _RETRIED or exc.status_code >= 500)
            ):
                return None
            after = _retry_after(headers)
            if after is not None and after > MAX_RETRY_AFTER:
                return None
        elif isinstance(exc, o.APIConnectionError):  # includes APITimeoutError
            after = None
        else:
            return None
        if after is None or after <= 0:
            first, largest = _BACKOFF
            after = min(first * 2.0**attempt, largest) * (1 - 0.25 * random.random())
        return after if after < call.left() else None

    async def _ainfo(self, call: _Call) -> None:
        """Ask for :meth:`info` off the event loop, within ``call``'s deadline (the adapters
        read ``name`` afterwards)."""
        if self._info is None:
            await asyncio.to_thread(self._info_within, max(call.left(), 0.001))

    def _async(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = self._openai.AsyncOpenAI(
                **self._options, http_client=_async_http(self._openai, self._httpx, self._max_bytes)
            )
        return client

    @staticmethod
    def _body(query: str, passages: Any, kw: dict[str, Any]) -> dict[str, Any]:
        """The ``chat.completions.create`` arguments of one core call."""
        unknown = sorted(set(kw) - set(_CALL_KEYS) - {"batching"})
        if unknown:
            raise TypeError(f"a server call cannot take {', '.join(unknown)}")
        messages = []
        if kw.get("system_prompt") is not None:
            messages.append({"role": "system", "content": kw["system_prompt"]})
        messages += [dict(m) for m in kw.get("messages") or []]
        messages.append({"role": "user", "content": query})
        tokrag: dict[str, Any] = {
            "policy": kw.get("policy", "tokrag"),
            "policy_options": json_data(dict(kw.get("policy_options") or {})),
            "trace": True,
        }
        for key in ("prompt_format", "max_context_tokens", "citations"):
            if kw.get(key) is not None:
                tokrag[key] = kw[key]
        rendered = kw.get("rendered")
        if rendered is not None:
            form = (
                {"text": rendered.text}
                if rendered.text is not None
                else {"messages": rendered.messages}
            )
            tokrag["rendered"] = {"context": rendered.context, **form}
            if rendered.passages is not None:
                tokrag["rendered"]["passages"] = _documents(rendered.passages)
        extra: dict[str, Any] = {"tokrag": tokrag}
        if passages is not None and (passages or rendered is None):
            extra["documents"] = _documents(as_passages(passages))
        return {
            "model": "tokrag",  # the server answers with the model it serves
            "messages": messages,
            "max_tokens": int(kw.get("max_new_tokens", 64)),
            "stop": list(kw.get("stop") or []),  # [] = none (absent: the server's default)
            "extra_body": extra,
        }

    def _parsed(self, parse: Callable[[Any], Any], response: Any) -> Any:
        """``parse(json)`` of a finished answer's body; a malformed one is a RemoteError."""
        try:
            data = json.loads(response.content)
        except ValueError:
            head = response.content[:60].decode("utf-8", "replace")
            raise self._malformed(f"is not JSON (it starts {head!r})", response) from None
        try:
            return parse(data)
        except _Malformed as exc:
            raise self._malformed(str(exc), response) from None

    def _at(self) -> str:
        return f"the tokrag server at {self.base_url}"

    def _malformed(self, what: str, response: Any) -> RemoteError:
        status = getattr(response, "status_code", None)
        return RemoteError(
            f"{self._at()} sent an answer that {what}: is base_url a `tokrag serve` /v1 address?",
            status,
        )

    def _timeout(self) -> TimeoutError:
        return TimeoutError(f"{self._at()} did not answer within timeout={self.timeout:g} s")

    def _error(self, exc: Exception, call: _Call | None = None, retries: int = 0) -> Exception:
        """``exc`` (an ``openai`` or ``httpx`` error, or a refused answer) as one sentence
        naming the server (never the key)."""
        at, o = self._at(), self._openai
        refused = _refusal(exc)
        if refused is not None:
            return RemoteError(f"{at} sent an answer that {refused.reason}")
        if isinstance(exc, json.JSONDecodeError):
            return self._malformed(f"holds an event that is not JSON ({exc.msg})", None)
        if isinstance(exc, o.APITimeoutError) or (call is not None and call.expired()):
            return self._timeout()
        if isinstance(exc, (o.APIConnectionError, self._httpx.HTTPError)):
            return ConnectionError(
                f"cannot connect to {at} (after {retries} retries): is `tokrag serve` "
                "running there, and is base_url its /v1 address?"
            )
        body = getattr(exc, "body", None)
        message = body.get("message") if isinstance(body, dict) else None
        message = str(message or getattr(exc, "message", None) or str(exc))[:500]
        status = getattr(exc, "status_code", None)
        if status is not None and 300 <= status < 400:
            where = redacted(exc.response.headers.get("location", "nowhere"))
            return RemoteError(
                f"{at} redirected the request ({status}) to {where[:200]!r}; the client "
                "follows no redirect (the body holds the question and documents): set "
                "base_url to the address that answers",
                status,
            )
        if status == 401:
            return PermissionError(
                f"{at} refused the API key (401): pass the server's key as api_key= (or set "
                f"${config.API_KEY})"
            )
        if status == 404:
            return RemoteError(f"{at} has no such route (404): base_url must end with /v1", 404)
        if status is None and isinstance(body, dict) and body.get("type") == "server_error":
            return RemoteError(f"{at} failed: {message}")  # an error event inside a stream
        if status is None or (400 <= status < 500 and status not in (408, 429)):
            return ValueError(f"{at} refused the request: {message}")  # bad input, as locally
        return RemoteError(f"{at} answered {status} (after {retries} retries): {message}", status)


def _refusal(exc: BaseException | None) -> _Refused | None:
    """The :class:`_Refused` behind ``exc`` (the openai client wraps what httpx raised)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _Refused):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _retry_after(headers: Any) -> float | None:
    """Seconds a ``retry-after-ms`` or ``Retry-After`` header asks to wait (None: none)."""
    with suppress(TypeError, ValueError):
        return float(headers.get("retry-after-ms")) / 1000
    value = headers.get("retry-after")
    with suppress(TypeError, ValueError):
        return float(value)
    import email.utils

    with suppress(TypeError, ValueError, OverflowError, OSError):
        when = email.utils.parsedate_tz(value)
        if when is not None:
            return float(email.utils.mktime_tz(when) - time.time())
    return None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _model_info(data: Any) -> dict[str, Any]:
    """``/v1/models``' first model, checked (the fields the adapters read)."""
    models = data.get("data") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict):
        raise _Malformed("lists no model under 'data'")
    info = models[0]
    window, eos = info.get("context_window"), info.get("eos_token_ids")
    if not isinstance(info.get("id"), str):
        raise _Malformed("names its model with no string 'id'")
    if not _is_int(window) or window < 1:
        raise _Malformed(f"gives 'context_window' {str(window)[:40]}, not a positive integer")
    if not isinstance(info.get("chat"), bool):
        raise _Malformed("gives no boolean 'chat'")
    if not isinstance(eos, list) or not all(_is_int(t) for t in eos):
        raise _Malformed("gives 'eos_token_ids' that is not a list of integers")
    return info


def _answer(data: Any) -> GenerationResult:
    """A chat completion's body (with its ``tokrag`` object) as the core's result."""
    if not isinstance(data, dict):
        raise _Malformed(f"is a JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _Malformed("has no 'choices'")
    message = choices[0].get("message")
    text = message.get("content") if isinstance(message, dict) else None
    if not isinstance(text, str | None) or not isinstance(message, dict):
        raise _Malformed("has no message text in choices[0]")
    return _result(data.get("tokrag"), text or "")


def _result(tokrag: Any, text: str) -> GenerationResult:
    """A server answer's ``tokrag`` object (with its trace) as the core's result."""
    if not isinstance(tokrag, dict):
        raise _Malformed("has no 'tokrag' object")
    if not isinstance(tokrag.get("trace"), dict):
        raise _Malformed("has no 'tokrag.trace' object")
    try:
        trace = Trace.from_dict(tokrag["trace"])
    except ValueError as exc:
        raise _Malformed(f"holds a malformed trace ({exc})") from None
    return GenerationResult(text=text, trace=trace, token_ids=[s.token_id for s in trace.steps])


def _plain(chunk: Any) -> Any:
    """A stream chunk as the JSON data it was sent as (the ``openai`` client wraps it)."""
    to_dict = getattr(chunk, "to_dict", None)
    return to_dict(warnings=False) if to_dict is not None else chunk


class _Parser:
    """Chat-completion chunks -> :class:`TokenEvent` objects, then the result. A stream
    with more token events than the ``max_tokens`` it asked for is malformed."""

    def __init__(self, max_tokens: int) -> None:
        self.index = 0
        self.text = ""
        self.max_tokens = max_tokens

    def feed(self, chunk: Any) -> TokenEvent | GenerationResult | None:
        data = _plain(chunk)
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise _Malformed("holds an event that is not a chat completion chunk")
        extra = data.get("tokrag")
        if not data["choices"] or extra is None:
            return None  # the opening role chunk, the usage chunk
        choice = data["choices"][0]
        if not isinstance(choice, dict) or not isinstance(extra, dict):
            raise _Malformed("holds an event whose choice or 'tokrag' is not an object")
        if choice.get("finish_reason") is not None:
            return _result(extra, self.text)
        delta = choice.get("delta")
        text = (delta.get("content") if isinstance(delta, dict) else None) or ""
        token_id, source = extra.get("token_id"), extra.get("source")
        if not isinstance(text, str) or not _is_int(token_id) or not isinstance(source, str):
            raise _Malformed("holds a token event without its text, 'token_id' and 'source'")
        if self.index >= self.max_tokens:
            raise _Malformed(f"streams more tokens than the max_tokens={self.max_tokens} asked")
        self.text += text
        step = TraceStep(self.index, token_id, text, source)
        self.index += 1
        return TokenEvent(0, step.index, step.token_id, text, step.source, step)

    def unfinished(self) -> str:
        return f"ended after {self.index} token(s), before its last event (with the trace)"


class RemoteStream:
    """Iterator of a server stream's :class:`TokenEvent` objects (their ``step`` holds the
    token and its source; the full steps are in ``result.trace``); ``result`` after it."""

    def __init__(self, model: RemoteModel, events: Any, call: _Call, max_tokens: int) -> None:
        self._model, self._events, self._call = model, events, call
        self._max_tokens = max_tokens
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        m, parser = self._model, _Parser(self._max_tokens)
        errors = (m._openai.OpenAIError, m._httpx.HTTPError, _Refused, json.JSONDecodeError)
        try:
            for chunk in self._events:
                if self._call.expired():
                    raise m._timeout()
                try:
                    item = parser.feed(chunk)
                except _Malformed as exc:
                    raise m._malformed(str(exc), None) from None
                if isinstance(item, GenerationResult):
                    self.result = item
                    return
                if item is not None:
                    yield item
            if self._call.expired():  # the watchdog's shutdown reads as the stream's end
                raise m._timeout()
            raise m._malformed(parser.unfinished(), None)
        except errors as exc:
            raise m._error(exc, self._call) from None
        finally:
            self.close()

    def close(self) -> None:
        self._call.stop()
        self._events.close()


def _documents(passages: Any) -> list[dict[str, Any]]:
    """Core passages as the server's ``{text, score, metadata}`` documents."""
    return [
        {"text": p.text, "score": p.score, "metadata": json_data(dict(p.metadata))} for p in passages
    ]
