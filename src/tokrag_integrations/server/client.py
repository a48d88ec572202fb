"""``RemoteModel``: the core's ``generate`` / ``stream`` / ``agenerate`` / ``astream_with_result``
decoded on a ``tokrag serve`` server instead of a local model, returning the same
:class:`~tokrag_integrations.GenerationResult` (trace included) and
:class:`~tokrag_integrations.TokenEvent` objects. ``TokRAGLLM(base_url=...)`` and
``ChatTokRAG(base_url=...)`` swap it in for their ``LoadedModel``.

The HTTP side is the ``openai`` client (the ``remote`` extra): timeouts, retries on 408, 429
and 5xx that honour ``Retry-After`` (up to 60 s), server-sent events, sync and async. The
request carries the core call's arguments: ``messages`` = system prompt + history + question,
``documents`` = the passages, ``tokrag`` = policy, options, prompt format, context budget,
citations and a template-formatted prompt (``rendered``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from .. import config
from ..prompts import as_passages
from ..results import GenerationResult, TokenEvent
from ..trace import Trace, TraceStep, json_data

__all__ = ["RemoteError", "RemoteModel"]

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


class RemoteError(RuntimeError):
    """The server failed to answer (``status``: its HTTP status, None without a response)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RemoteModel:
    """A ``tokrag serve`` server at ``base_url`` (``http://host:8000/v1``) in place of a
    ``LoadedModel``: :meth:`generate`, :meth:`stream`, :meth:`agenerate` and
    :meth:`astream_with_result` take the core's arguments and return its types.

    ``api_key``: the server's bearer token (default ``$TOKRAG_API_KEY``; never shown in a
    repr, message or log). ``timeout``: seconds per request; ``max_retries``: retries of a
    request that failed to connect or got 408 / 429 / 5xx, waiting ``Retry-After`` when the
    server sends it.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 120.0,
        max_retries: int = 2,
    ) -> None:
        try:
            import openai
        except ModuleNotFoundError:
            raise ImportError(
                "base_url= needs the openai package: pip install 'tokrag-integrations[remote]'"
            ) from None
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(
                f"base_url must be an http(s) URL such as http://host:8000/v1, got {base_url!r}"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout, self.max_retries = float(timeout), int(max_retries)
        key = api_key if api_key is not None else config.api_key()
        self._options = {
            "base_url": self.base_url,
            "api_key": key or "unused",
            "timeout": self.timeout,
            "max_retries": self.max_retries,
        }
        self._openai = openai
        self._client = openai.OpenAI(**self._options)
        # One async client per event loop: an httpx pool belongs to the loop that opened it.
        self._aclients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._info: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return f"RemoteModel(base_url={self.base_url!r})"

    # ------------------------------------------------------------------ the served model
    def info(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` describes it (asked once): ``id``,
        ``context_window``, ``chat``, ``eos_token_ids``."""
        if self._info is None:
            try:
                data = self._client.models.list().data
            except self._openai.OpenAIError as exc:
                raise self._error(exc) from None
            self._info = data[0].model_dump()
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
        try:
            r = self._client.chat.completions.create(**self._body(query, passages, kw))
        except self._openai.OpenAIError as exc:
            raise self._error(exc) from None
        return _result(r.model_extra["tokrag"], r.choices[0].message.content or "")

    def stream(self, query: str, passages: Any = None, **kw: Any) -> RemoteStream:
        """:func:`tokrag_integrations.stream` on the server: token events as they arrive,
        ``.result`` after the last."""
        try:
            events = self._client.chat.completions.create(
                stream=True, **self._body(query, passages, kw)
            )
        except self._openai.OpenAIError as exc:
            raise self._error(exc) from None
        return RemoteStream(self, events)

    async def agenerate(self, query: str, passages: Any = None, **kw: Any) -> GenerationResult:
        """:func:`tokrag_integrations.agenerate` on the server."""
        await self._ainfo()
        try:
            r = await self._async().chat.completions.create(**self._body(query, passages, kw))
        except self._openai.OpenAIError as exc:
            raise self._error(exc) from None
        return _result(r.model_extra["tokrag"], r.choices[0].message.content or "")

    async def astream_with_result(
        self, query: str, passages: Any = None, **kw: Any
    ) -> AsyncIterator[TokenEvent | GenerationResult]:
        """Every :class:`TokenEvent`, then the :class:`GenerationResult` (as the core's)."""
        await self._ainfo()
        try:
            events = await self._async().chat.completions.create(
                stream=True, **self._body(query, passages, kw)
            )
        except self._openai.OpenAIError as exc:
            raise self._error(exc) from None
        parser = _Parser()
        try:
            async for chunk in events:
                item = parser.feed(chunk)
                if item is not None:
                    yield item
        except self._openai.OpenAIError as exc:
            raise self._error(exc) from None
        finally:
            await events.close()  # a stream left early: its connection goes back now

    # ------------------------------------------------------------------ plumbing
    async def _ainfo(self) -> None:
        """Ask for :meth:`info` off the event loop (the adapters read ``name`` afterwards)."""
        if self._info is None:
            await asyncio.to_thread(self.info)

    def _async(self) -> Any:
        loop = asyncio.get_running_loop()
        client = self._aclients.get(loop)
        if client is None:
            client = self._aclients[loop] = self._openai.AsyncOpenAI(**self._options)
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

    def _error(self, exc: Exception) -> Exception:
        """``exc`` (an ``openai`` error) as one sentence naming the server (never the key)."""
        at = f"the tokrag server at {self.base_url}"
        o = self._openai
        if isinstance(exc, o.APITimeoutError):
            return TimeoutError(f"{at} did not answer within timeout={self.timeout:g} s")
        if isinstance(exc, o.APIConnectionError):
            return ConnectionError(
                f"cannot connect to {at} (after {self.max_retries} retries): is `tokrag serve` "
                "running there, and is base_url its /v1 address?"
            )
        body = getattr(exc, "body", None)
        message = body.get("message") if isinstance(body, dict) else None
        message = message or getattr(exc, "message", str(exc))
        status = getattr(exc, "status_code", None)
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
        return RemoteError(
            f"{at} answered {status} (after {self.max_retries} retries): {message}", status
        )


class _Parser:
    """Chat-completion chunks -> :class:`TokenEvent` objects, then the result."""

    def __init__(self) -> None:
        self.index = 0
        self.text = ""

    def feed(self, chunk: Any) -> TokenEvent | GenerationResult | None:
        extra = (chunk.model_extra or {}).get("tokrag")
        if not chunk.choices or extra is None:
            return None  # the opening role chunk, the usage chunk
        choice = chunk.choices[0]
        if choice.finish_reason is not None:
            return _result(extra, self.text)
        text = choice.delta.content or ""
        self.text += text
        step = TraceStep(self.index, extra["token_id"], text, extra["source"])
        self.index += 1
        return TokenEvent(0, step.index, step.token_id, text, step.source, step)


class RemoteStream:
    """Iterator of a server stream's :class:`TokenEvent` objects (their ``step`` holds the
    token and its source; the full steps are in ``result.trace``); ``result`` after it."""

    def __init__(self, model: RemoteModel, events: Any) -> None:
        self._model, self._events = model, events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        parser = _Parser()
        try:
            for chunk in self._events:
                item = parser.feed(chunk)
                if isinstance(item, GenerationResult):
                    self.result = item
                elif item is not None:
                    yield item
        except self._model._openai.OpenAIError as exc:
            raise self._model._error(exc) from None
        finally:
            self._events.close()

    def close(self) -> None:
        self._events.close()


def _result(tokrag: dict[str, Any], text: str) -> GenerationResult:
    """A server answer's ``tokrag`` object (with its trace) as the core's result."""
    trace = Trace.from_dict(tokrag["trace"])
    return GenerationResult(text=text, trace=trace, token_ids=[s.token_id for s in trace.steps])


def _documents(passages: Any) -> list[dict[str, Any]]:
    """Core passages as the server's ``{text, score, metadata}`` documents."""
    return [
        {"text": p.text, "score": p.score, "metadata": json_data(dict(p.metadata))} for p in passages
    ]
