"""The OpenAI-compatible HTTP app (FastAPI): ``/health``, ``/v1/models``, ``/v1/chat/completions``,
``/metrics`` (Prometheus; :mod:`.telemetry`).

    from tokrag_integrations.server import ChatService, ServeConfig, create_app
    app = create_app(ChatService.load(ServeConfig(policy="tokrag")))   # any ASGI server runs it

A chat completion is the standard OpenAI object plus a top-level ``tokrag`` object (policy,
counts per source, trace, warnings, sources, citations); streamed answers are
``chat.completion.chunk`` server-sent events, each content chunk with ``tokrag.source``, the
last with the full ``tokrag`` object. Refusals are OpenAI-style JSON errors: 400 bad body,
401 no bearer token, 413 body over the limit, 429 ``max_queue`` reached, 503 while the model
loads. Decoding runs off the event loop, through the model's micro-batcher; a client that
disconnects cancels its request.
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations (``Request``)
# at definition time, and ``Request`` is imported inside create_app to keep imports lazy.
import asyncio
import copy
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict
from typing import Any

from ..adapters.translate import FINISH_REASONS, usage
from .schemas import ChatRequest, RequestError, parse_chat_request, too_deep
from .service import API_KEY_ENV, ChatService, ServeConfig
from .telemetry import METRICS_MODES, RequestLog, Telemetry

__all__ = ["create_app", "serve"]

log = logging.getLogger("tokrag.serve")

_END = object()


def tokrag_object(result: Any, req: ChatRequest, extra_warnings: list[str]) -> dict[str, Any]:
    """The response's ``tokrag`` object for one :class:`~tokrag_integrations.GenerationResult`:
    ``sources`` by their share of the answer's attention (``contribution``; None: not cited),
    then in prompt order (``rank``, which a citation's ``passage`` names); ``citations`` the
    answer's spans (:meth:`~tokrag_integrations.trace.Trace.citations_data`; [] where no token
    carries one)."""
    tr = result.trace
    shares = dict(tr.contributions())
    return {
        "policy": tr.policy,
        "counts": tr.counts(),
        "stop_reason": tr.stop_reason,
        "prompt_tokens": dict(tr.prompt_tokens),
        "warnings": [*tr.warnings, *req.warnings, *extra_warnings],
        "sources": [
            {**asdict(tr.passages[i]), "contribution": shares.get(i)} for i in tr.passage_order()
        ],
        "citations": tr.citations_data(),
        "trace": tr.to_dict() if req.trace else None,
    }


def create_app(
    service: ChatService | None = None,
    *,
    loader: Callable[[], ChatService] | None = None,
    config: ServeConfig | None = None,
    echo_request_id: bool = True,
) -> Any:
    """The FastAPI app answering with ``service``, or with what ``loader()`` returns once it
    has run in a background thread at startup (``/health`` says 503 until then).

    ``config`` gives the HTTP settings when there is no service yet (default: the service's).
    ``echo_request_id=False``: the responses' ``x-request-id`` is left to a proxy in front that
    sets it (Ray Serve's); the log lines still carry it.
    """
    from fastapi import FastAPI, Request, Response
    from fastapi.responses import JSONResponse, StreamingResponse

    if (service is None) == (loader is None):
        raise ValueError("give a service or a loader, not both and not neither")
    cfg = config or (service.config if service is not None else ServeConfig())
    if cfg.metrics not in METRICS_MODES:
        raise ValueError(f"metrics must be one of {', '.join(METRICS_MODES)}; got {cfg.metrics!r}")
    state: dict[str, Any] = {"service": service, "error": None}
    # Which replica answered, without saying anything about the host (a pid would).
    replica = uuid.uuid4().hex[:12]
    api_key = cfg.resolved_api_key()

    def load_in_background() -> None:
        try:
            state["service"] = loader()  # type: ignore[misc]
        except Exception as exc:  # reported by /health and every request
            log.exception("loading the model failed")
            # The message stays in the log: it may name the model's folder, and /health is
            # open to anyone who can reach the port.
            state["error"] = f"{type(exc).__name__}; see the server log"

    @asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        # Each waiting or decoding request holds a worker thread (the batcher's leader sleeps
        # in one while companions arrive): size the loop's default pool to the queue limit.
        pool = ThreadPoolExecutor(max_workers=cfg.max_queue + 8, thread_name_prefix="tokrag-serve")
        asyncio.get_running_loop().set_default_executor(pool)
        if loader is not None and state["service"] is None:
            threading.Thread(target=load_in_background, name="tokrag-load", daemon=True).start()
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    # No docs pages (/docs, /redoc) at all; the OpenAPI schema is served by the route below,
    # behind the API key when one is set (it lists the routes and every field they take).
    app = FastAPI(title="tokrag", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    telemetry = Telemetry(state)
    # Request ids, the replica header, requests counted and logged, unexpected errors as 500s.
    app.add_middleware(RequestLog, telemetry=telemetry, replica=replica, echo_id=echo_request_id)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> Any:
        return JSONResponse(exc.to_dict(), status_code=exc.status)

    @app.get("/health")
    async def health() -> Any:
        svc = state["service"]
        if svc is None:
            status = "failed" if state["error"] else "loading"
            return JSONResponse({"status": status, "error": state["error"]}, status_code=503)
        b = svc.batcher
        return {"status": "ok", "model": svc.model_id, "active": svc.active,
                "streams_cut": svc.streams_cut,
                "max_queue": cfg.max_queue, "replica": replica,
                "batching": {"continuous": b.continuous, "max_rows": b.max_rows,
                             "max_prefill_tokens": b.max_prefill_tokens,
                             "batches": b.batches, "batched_calls": b.batched_calls,
                             "joined_calls": b.joined_calls, "peak_rows": b.peak_rows}}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Any:
        _authorize(request, api_key)
        return JSONResponse(app.openapi())

    if cfg.metrics != "off":

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Any:
            if cfg.metrics == "key":
                _authorize(request, api_key)
            body, content_type = telemetry.exposition(request.headers.get("accept"))
            return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        _authorize(request, api_key)
        svc = _ready(state)
        lm = svc.lm
        return {"object": "list", "data": [
            {"id": svc.model_id, "object": "model", "created": 0, "owned_by": "tokrag",
             "context_window": lm.context_window, "chat": bool(lm.is_chat),
             "eos_token_ids": sorted(lm.eos_token_ids)}
        ]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        started = time.perf_counter()
        _authorize(request, api_key)
        svc = _ready(state)
        body = await _read_json(request, cfg.limits.max_body_bytes)
        req = parse_chat_request(body, cfg.limits, svc.policies)
        if svc.active >= cfg.max_queue:
            return JSONResponse(
                RequestError(f"the server is busy: {cfg.max_queue} requests are queued; retry "
                             "later", None, 429, "rate_limit_error").to_dict(),
                status_code=429, headers={"Retry-After": "1"},
            )
        svc.active += 1
        handed_over = False
        try:
            passages, notes = await svc.passages(req)
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": svc.model_id,
            }
            if req.stream:
                token_stream = await svc.open_stream(req, passages)
                handed_over = True  # the event generator releases the slot
                return StreamingResponse(
                    _events(svc, req, token_stream, head, notes, telemetry, started),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            result = await _unless_disconnected(request, svc.complete(req, passages))
            if result is None:  # the client left; nobody reads a response
                return JSONResponse({}, status_code=499)
            counted = usage(result)
            telemetry.answered(result, counted["prompt_tokens"], started)
            return {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": result.text},
                        "finish_reason": FINISH_REASONS.get(result.stop_reason, "stop"),
                        "logprobs": None,
                    }
                ],
                "usage": counted,
                "tokrag": tokrag_object(result, req, notes),
            }
        finally:
            if not handed_over:
                svc.active -= 1

    app.state.tokrag = state
    return app


def _ready(state: dict[str, Any]) -> ChatService:
    """The loaded service, or a 503 saying why there is none yet."""
    if state["error"] is not None:
        raise RequestError(f"the model failed to load: {state['error']}", None, 503,
                           "server_error")
    svc = state["service"]
    if svc is None:
        raise RequestError("the model is still loading; retry shortly", None, 503,
                           "server_error")
    return svc


def _authorize(request: Any, api_key: str | None) -> None:
    """A 401 unless the request carries ``Authorization: Bearer <api_key>`` (no key: open)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise RequestError("missing or wrong API key: send 'Authorization: Bearer <key>'",
                           None, 401, "authentication_error")


async def _read_json(request: Any, max_body_bytes: int) -> Any:
    """The body as JSON, read in chunks and refused (413) once over ``max_body_bytes``."""
    length = request.headers.get("content-length")
    too_big = RequestError(
        f"the request body is larger than this server's limit of {max_body_bytes} "
        "bytes", None, 413
    )
    if length is not None and length.isdigit() and int(length) > max_body_bytes:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise too_big
    try:
        return json.loads(body)
    except RecursionError:  # nested past the decoder's stack; the depth check reads the rest
        raise too_deep() from None
    except ValueError as exc:  # bad JSON or UTF-8; an integer of over 4300 digits
        raise RequestError(f"the body is not valid JSON: {exc}") from None


async def _unless_disconnected(request: Any, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and return None."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task
                return None
    except asyncio.CancelledError:
        task.cancel()
        raise


def _finite(data: Any) -> Any:
    """``data`` with NaN and the infinities as None (JSON has no such numbers; the plain
    answer's encoder writes them as null too)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(v) for v in data]
    return data


def _sse(data: Any) -> bytes:
    """One server-sent event of ``data`` as strict JSON (never a bare ``NaN``)."""
    text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)
    return f"data: {text}\n\n".encode()


async def _events(
    svc: ChatService, req: ChatRequest, token_stream: Any, head: dict[str, Any], notes: list[str],
    telemetry: Telemetry, started: float,
) -> AsyncIterator[bytes]:
    """Server-sent events for one stream. The decode is read by a thread of its own as fast
    as the model goes and queued here, so the model is released when the answer is done,
    however slowly the client reads; closing this generator (the client left) stops it.
    ``telemetry`` gets its first token and its answer (the request arrived at ``started``)."""
    from ..results import TokenEvent

    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        with suppress(RuntimeError):  # the loop is gone: nobody listens
            loop.call_soon_threadsafe(events.put_nowait, item)

    def pump() -> None:
        try:
            for ev in token_stream:
                put(ev)
            put(token_stream.result)
        except BaseException as exc:  # noqa: BLE001 - handed to the response
            put(exc)
        finally:
            put(_END)

    def chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> bytes:
        """One ``chat.completion.chunk`` event (no ``delta``: no choice, the usage chunk)."""
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        choices = [] if delta is None else [choice]
        return _sse({**head, "object": "chat.completion.chunk", "choices": choices, **extra})

    thread = threading.Thread(target=pump, name="tokrag-sse", daemon=True)
    finished = first = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        thread.start()
        while True:
            item = await events.get()
            if item is _END:
                break
            if isinstance(item, TokenEvent):  # one chunk per token, some with empty text
                if not first:
                    first = True
                    telemetry.first_token(started)
                yield chunk({"content": item.text},
                            tokrag={"source": item.source, "token_id": item.token_id})
            elif isinstance(item, BaseException):
                if isinstance(item, (TypeError, ValueError)):
                    body = RequestError(str(item)).to_dict()
                else:
                    log.error("stream failed", exc_info=item)
                    body = RequestError(f"internal error ({type(item).__name__}); see the "
                                        "server log", None, 500, "server_error").to_dict()
                yield _sse(body)
            else:  # the GenerationResult
                finished = True
                telemetry.answered(item, usage(item)["prompt_tokens"], started)
                finish = FINISH_REASONS.get(item.stop_reason, "stop")
                yield chunk({}, finish, tokrag=tokrag_object(item, req, notes))
                if req.include_usage:
                    yield chunk(None, usage=usage(item))
        yield b"data: [DONE]\n\n"
    finally:
        # No await here: when the client leaves, this runs inside a cancelled scope, where
        # every await raises again. Closing stops the decode at its next step (its thread
        # then releases the model and the pump thread ends).
        token_stream.close()
        if not finished:
            svc.streams_cut += 1
        svc.active -= 1


def is_local(host: str) -> bool:
    """Whether ``host`` binds to the loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(host: str, config: ServeConfig) -> None:
    """Warn when the server listens beyond this machine without a bearer token."""
    if not is_local(host) and config.resolved_api_key() is None:
        warnings.warn(
            f"serving on {host} without an API key: anyone who can reach this port can use the "
            f"model; pass --api-key or set ${API_KEY_ENV}",
            UserWarning,
            stacklevel=2,
        )


def serve(config: ServeConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", **uvicorn_kwargs: Any) -> None:
    """``tokrag serve`` in one process: uvicorn on ``host:port``; the model loads in the
    background (``/health`` is 503 until it is ready). Blocks until the server stops; SIGTERM
    ends it as Ctrl-C does and stops an embedded Postgres (the handler is set here, in the
    main thread: :func:`~..postgres.embedded.stop_on_sigterm`)."""
    from ..postgres.embedded import stop_on_sigterm

    try:
        import uvicorn

        app = create_app(loader=lambda: ChatService.load(config), config=config)
    except ModuleNotFoundError as exc:
        if exc.name not in ("fastapi", "uvicorn", "starlette", "prometheus_client"):
            raise
        raise ImportError(
            f"tokrag serve needs FastAPI, uvicorn and prometheus-client ({exc.name} is missing): "
            "pip install 'tokrag-integrations[serve]'"
        ) from None
    warn_if_open(host, config)
    stop_on_sigterm()
    # One line per request, the app's own (with its request id) instead of uvicorn's access
    # log; the ``tokrag`` loggers write where uvicorn's do.
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["tokrag"] = {"handlers": ["default"], "level": log_level.upper(),
                                       "propagate": False}
    uvicorn.run(app, host=host, port=port, log_level=log_level, **{
        "access_log": False, "log_config": log_config, **uvicorn_kwargs})
