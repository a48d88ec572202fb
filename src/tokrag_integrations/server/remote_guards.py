"""The remote client's guards. What :class:`~.client.RemoteModel` adds to the ``openai`` client, because a server may be slow, broken or hostile
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

import contextvars
import math
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import suppress
from typing import Any

from ..defaults import REMOTE_MAX_RESPONSE_MB

__all__ = ["MAX_RESPONSE_MB", "RemoteError", "redacted"]

#: Default ``max_response_mb`` (:data:`..defaults.REMOTE_MAX_RESPONSE_MB`).
MAX_RESPONSE_MB = REMOTE_MAX_RESPONSE_MB
#: The largest ``timeout`` (seconds, about 115 days): what a timer and a socket can wait.
MAX_TIMEOUT = 1e7
#: The longest ``Retry-After`` (seconds) honoured; a longer one is not retried.
MAX_RETRY_AFTER = 60.0
#: Exponential backoff between retries without ``Retry-After``: first wait and largest wait.
BACKOFF = (0.5, 8.0)
#: Statuses retried (as the ``openai`` client does): timeouts, conflicts, rate limits, 5xx.
RETRIED = frozenset({408, 409, 429})

#: ``user:password@`` (or ``user@``) in a URL's authority, with or without a scheme.
USERINFO = re.compile(r"^((?:[^:/?#]*:)?//)?[^/?#]*@")


class RemoteError(RuntimeError):
    """The server failed to answer (``status``: its HTTP status, None without a response)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Refused(Exception):
    """The client stopped reading an answer; ``reason`` completes "sent an answer that ..."."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Malformed(ValueError):
    """An answer that is not the server's format; the message says what is wrong."""


def redacted(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@`` (for messages)."""
    return USERINFO.sub(lambda m: f"{m.group(1) or ''}***@", url, count=1)


class Call:
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
            shutdown(sock)

    def _fire(self) -> None:
        with self._lock:
            self.fired, sock = True, self._sock
        if sock is not None:
            shutdown(sock)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._sock = None


#: The call in progress in this context (its deadline and watchdog), for the request hook.
CURRENT_CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("tokrag_call", default=None)


def shutdown(sock: Any) -> None:
    # socket.socket's own shutdown, also for an SSLSocket (whose override would unwrap it
    # from this thread while the request's thread reads it).
    with suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def on_request(request: Any) -> None:
    """httpx request hook (sync client): the call's watchdog learns the request's sockets."""
    call = CURRENT_CALL.get()
    if call is not None:
        request.extensions["trace"] = call.trace


def checked_head(response: Any, max_bytes: int) -> None:
    """Refuse, before its body, an answer announced larger than the cap or compressed."""
    length = response.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise Refused(f"announces {int(length)} bytes, over {cap_text(max_bytes)}")
    coding = response.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise Refused(
            f"is compressed (Content-Encoding: {coding[:40]!r}), which the client did not ask for"
        )


def cap_text(max_bytes: int) -> str:
    return f"max_response_mb={max_bytes / 2**20:g} ({max_bytes} bytes)"


class Counted:
    """Counts a body's bytes as they arrive and stops the read past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.seen = max_bytes, 0

    def add(self, chunk: bytes) -> None:
        self.seen += len(chunk)
        if self.seen > self.max_bytes:
            raise Refused(f"is larger than {cap_text(self.max_bytes)}")


def sync_http(openai: Any, httpx: Any, max_bytes: int) -> Any:
    """The sync client's httpx client: no redirects, no compression, no kept-alive
    connection (each request's socket is new, so the watchdog always learns it), a counted
    body."""

    class Capped(httpx.SyncByteStream):
        def __init__(self, inner: Any) -> None:
            self._inner, self._count = inner, Counted(max_bytes)

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self._inner:
                self._count.add(chunk)
                yield chunk

        def close(self) -> None:
            self._inner.close()

    def on_response(response: Any) -> None:
        try:
            checked_head(response, max_bytes)
        except Refused:
            response.close()
            raise
        response.stream = Capped(response.stream)

    return openai.DefaultHttpxClient(
        follow_redirects=False,
        headers={"Accept-Encoding": "identity"},
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=0),
        event_hooks={"request": [on_request], "response": [on_response]},
    )


def async_http(openai: Any, httpx: Any, max_bytes: int) -> Any:
    """The async client's httpx client: as :func:`sync_http`, kept-alive connections
    allowed (a cancelled request's connection is dropped by httpx)."""

    class Capped(httpx.AsyncByteStream):
        def __init__(self, inner: Any) -> None:
            self._inner, self._count = inner, Counted(max_bytes)

        async def __aiter__(self) -> AsyncIterator[bytes]:
            async for chunk in self._inner:
                self._count.add(chunk)
                yield chunk

        async def aclose(self) -> None:
            await self._inner.aclose()

    async def on_response(response: Any) -> None:
        try:
            checked_head(response, max_bytes)
        except Refused:
            await response.aclose()
            raise
        response.stream = Capped(response.stream)

    return openai.DefaultAsyncHttpxClient(
        follow_redirects=False,
        headers={"Accept-Encoding": "identity"},
        event_hooks={"response": [on_response]},
    )


def checked_number(value: Any, name: str, *, most: float) -> float:
    """``value`` as a float above 0 and at most ``most``, else a ValueError naming ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if isinstance(value, bool) or not 0 < number <= most:
        raise ValueError(f"{name} must be a number above 0 and at most {most:g}, got {value!r}")
    return number



def refusal_in(exc: BaseException | None) -> Refused | None:
    """The :class:`Refused` behind ``exc`` (the openai client wraps what httpx raised)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, Refused):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def retry_after(headers: Any) -> float | None:
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
