"""The OpenAI-compatible HTTP app (FastAPI): ``/health``, ``/v1/models``, ``/v1/chat/completions``,
``/metrics`` (Prometheus; :mod:`.telemetry`).

    from tokrag_integrations.server import ChatService, ServeConfig, create_app
    app = create_app(ChatService.load(ServeConfig(policy="tokrag")))   # any ASGI server runs it

A chat completion is the standard OpenAI object (``n`` choices, each with its ``logprobs``
when asked and its ``tool_calls`` when the answer calls a tool: :mod:`.responses`) plus a
top-level ``tokrag`` object (policy, counts per source, sampling, trace, warnings, sources,
citations; with ``n`` > 1 each choice carries its own too); streamed answers are
``chat.completion.chunk`` server-sent events (:mod:`.streaming`), each token's chunk with
``tokrag.source``, the last of each choice with the full ``tokrag`` object. Refusals are OpenAI-style JSON errors: 400 bad body,
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
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from typing import Any

from ..adapters.translate import usage
from .refusals import RequestError, too_deep
from .responses import choice, tokrag_object, total_usage
from .schemas import parse_chat_request
from .service import API_KEY_ENV, ChatService, ServeConfig
from .streaming import events
from .telemetry import METRICS_MODES, RequestLog, Telemetry

__all__ = ["create_app", "serve"]

log = logging.getLogger("tokrag.serve")

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
            await asyncio.to_thread(svc.render, req)  # the chat template runs off the loop
            passages, notes = await svc.passages(req)
            head = {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": svc.model_id,
            }
            if req.stream:
                streams = await svc.open_streams(req, passages)
                # One stream per draw; a greedy n fans one stream out to every choice.
                fan = [[i] for i in range(req.n)] if len(streams) == req.n else [list(range(req.n))]
                handed_over = True  # the event generator releases the slot
                return StreamingResponse(
                    events(svc, req, streams, fan, head, notes, telemetry, started),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            results = await _unless_disconnected(request, svc.complete(req, passages))
            if results is None:  # the client left; nobody reads a response
                return JSONResponse({}, status_code=499)
            answers = results if len(results) == req.n else results * req.n
            telemetry.answered(results, usage(results[0])["prompt_tokens"], started)
            tokrag = [tokrag_object(r, req, notes) for r in answers]
            return {
                **head,
                "choices": [choice(i, r, req, tokrag[i] if req.n > 1 else None)
                            for i, r in enumerate(answers)],
                "usage": total_usage(answers),
                "tokrag": tokrag[0],
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
