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

The request and the answers' formats are in :mod:`.remote_wire`; the guards against a slow,
broken or hostile server (one deadline per call, a cap on an answer's size, no redirects, no
credentials in the URL) in :mod:`.remote_guards`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from .. import config
from ..results import GenerationResult, TokenEvent
from .remote_guards import (
    BACKOFF,
    CURRENT_CALL,
    MAX_RESPONSE_MB,
    MAX_RETRY_AFTER,
    MAX_TIMEOUT,
    RETRIED,
    USERINFO,
    Call,
    Malformed,
    Refused,
    RemoteError,
    async_http,
    checked_number,
    redacted,
    refusal_in,
    retry_after,
    sync_http,
)
from .remote_wire import Parser, answer, model_info, request_body

__all__ = ["RemoteModel", "RemoteStream"]


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
        if USERINFO.match(base_url):
            raise ValueError(
                f"base_url must not hold credentials ({redacted(base_url)!r}): pass the server's "
                f"key as api_key= (or set ${config.API_KEY})"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = checked_number(timeout, "timeout", most=MAX_TIMEOUT)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be a whole number >= 0, got {max_retries!r}")
        self.max_retries = max_retries
        self.max_response_mb = checked_number(max_response_mb, "max_response_mb", most=2**20)
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
            **self._options, http_client=sync_http(openai, httpx, self._max_bytes)
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
            raw = self._run(lambda t: list_models(timeout=t), Call(seconds, watch=True))
            self._info = self._parsed(model_info, raw.http_response)
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
        body = request_body(query, passages, kw)
        create = self._chat.with_raw_response.create
        raw = self._run(lambda t: create(timeout=t, **body))
        return self._parsed(answer, raw.http_response)

    def stream(self, query: str, passages: Any = None, **kw: Any) -> RemoteStream:
        """:func:`tokrag_integrations.stream` on the server: token events as they arrive,
        ``.result`` after the last. The deadline (``timeout``) covers the whole stream."""
        body = request_body(query, passages, kw)
        call = Call(self.timeout, watch=True)
        create = self._chat.create
        events = self._run(lambda t: create(stream=True, timeout=t, **body), call, keep=True)
        return RemoteStream(self, events, call, body["max_tokens"])

    async def agenerate(self, query: str, passages: Any = None, **kw: Any) -> GenerationResult:
        """:func:`tokrag_integrations.agenerate` on the server."""
        call = Call(self.timeout, watch=False)
        await self._ainfo(call)
        body = request_body(query, passages, kw)
        client = self._async()
        raw = await self._arun(
            lambda t: client.chat.completions.with_raw_response.create(timeout=t, **body), call
        )
        return self._parsed(answer, raw.http_response)

    async def astream_with_result(
        self, query: str, passages: Any = None, **kw: Any
    ) -> AsyncIterator[TokenEvent | GenerationResult]:
        """Every :class:`TokenEvent`, then the :class:`GenerationResult` (as the core's). The
        deadline (``timeout``) covers the whole stream."""
        import anyio

        call = Call(self.timeout, watch=False)
        await self._ainfo(call)
        body = request_body(query, passages, kw)
        client = self._async()
        events = await self._arun(
            lambda t: client.chat.completions.create(stream=True, timeout=t, **body), call
        )
        parser = Parser(body["max_tokens"])
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
                except (self._httpx.HTTPError, Refused, json.JSONDecodeError) as exc:
                    raise self._error(exc, call) from None
                try:
                    item = parser.feed(chunk)
                except Malformed as exc:
                    raise self._malformed(str(exc), None) from None
                if item is not None:
                    yield item
                if isinstance(item, GenerationResult):
                    return
        finally:
            await events.close()  # a stream left early: its connection goes back now

    # ------------------------------------------------------------------ plumbing
    def _run(self, send: Callable[[float], Any], call: Call | None = None, keep: bool = False):
        """``send(seconds_left)`` under one deadline with the retries; ``keep``: the call's
        watchdog stays on for the stream that ``send`` opened."""
        call = call or Call(self.timeout, watch=True)
        token = CURRENT_CALL.set(call)
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
            CURRENT_CALL.reset(token)
            if not keep:
                call.stop()

    async def _arun(self, send: Callable[[float], Any], call: Call | None = None) -> Any:
        """:meth:`_run` for the async client: each attempt and wait is cancelled at the
        deadline (``anyio.fail_after``)."""
        import anyio

        call = call or Call(self.timeout, watch=False)
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

    def _retry_wait(self, exc: Exception, attempt: int, call: Call) -> float | None:
        """Seconds to wait before retrying after ``exc`` (None: no retry): a failed
        connection or a retried status, with attempts left, and a wait that ends before the
        deadline. ``Retry-After`` (or ``retry-after-ms``) when given and at most
        :data:`MAX_RETRY_AFTER`, else the exponential backoff."""
        o = self._openai
        if attempt >= self.max_retries or call.expired() or refusal_in(exc) is not None:
            return None
        if isinstance(exc, o.APIStatusError):
            headers = exc.response.headers
            should = headers.get("x-should-retry")
            if should != "true" and (
                should == "false" or not (exc.status_code in RETRIED or exc.status_code >= 500)
            ):
                return None
            after = retry_after(headers)
            if after is not None and after > MAX_RETRY_AFTER:
                return None
        elif isinstance(exc, o.APIConnectionError):  # includes APITimeoutError
            after = None
        else:
            return None
        if after is None or after <= 0:
            first, largest = BACKOFF
            after = min(first * 2.0**attempt, largest) * (1 - 0.25 * random.random())
        return after if after < call.left() else None

    async def _ainfo(self, call: Call) -> None:
        """Ask for :meth:`info` off the event loop, within ``call``'s deadline (the adapters
        read ``name`` afterwards)."""
        if self._info is None:
            await asyncio.to_thread(self._info_within, max(call.left(), 0.001))

    def _async(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = self._openai.AsyncOpenAI(
                **self._options, http_client=async_http(self._openai, self._httpx, self._max_bytes)
            )
        return client

    def _parsed(self, parse: Callable[[Any], Any], response: Any) -> Any:
        """``parse(json)`` of a finished answer's body; a malformed one is a RemoteError."""
        try:
            data = json.loads(response.content)
        except ValueError:
            head = response.content[:60].decode("utf-8", "replace")
            raise self._malformed(f"is not JSON (it starts {head!r})", response) from None
        try:
            return parse(data)
        except Malformed as exc:
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

    def _error(self, exc: Exception, call: Call | None = None, retries: int = 0) -> Exception:
        """``exc`` (an ``openai`` or ``httpx`` error, or a refused answer) as one sentence
        naming the server (never the key)."""
        at, o = self._at(), self._openai
        refused = refusal_in(exc)
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


class RemoteStream:
    """Iterator of a server stream's :class:`TokenEvent` objects (their ``step`` holds the
    token and its source; the full steps are in ``result.trace``); ``result`` after it."""

    def __init__(self, model: RemoteModel, events: Any, call: Call, max_tokens: int) -> None:
        self._model, self._events, self._call = model, events, call
        self._max_tokens = max_tokens
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        m, parser = self._model, Parser(self._max_tokens)
        errors = (m._openai.OpenAIError, m._httpx.HTTPError, Refused, json.JSONDecodeError)
        try:
            for chunk in self._events:
                if self._call.expired():
                    raise m._timeout()
                try:
                    item = parser.feed(chunk)
                except Malformed as exc:
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
