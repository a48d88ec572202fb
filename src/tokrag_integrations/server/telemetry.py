"""What ``tokrag serve`` tells its operator: Prometheus metrics (``GET /metrics``) and a
request id with one log line per request.

:class:`Telemetry` holds the app's metrics in a registry of its own (several apps in one
process never share a series), made with ``prometheus_client``; the gauges read the service's
live values when scraped. :class:`RequestLog` is the ASGI middleware that gives every response
its ``x-request-id`` and ``x-tokrag-replica`` headers, counts it by route and status and logs
it (logger ``tokrag.serve``). docs/serving.md, "Metrics", lists the series.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any
from urllib.parse import quote

__all__ = ["METRICS_MODES", "RequestLog", "Telemetry", "logged_path", "request_id"]

log = logging.getLogger("tokrag.serve")

#: ``--metrics`` values: ``key``, ``/metrics`` needs the API key when one is set (as ``/v1/*``);
#: ``open``, it never does (a Prometheus inside the network scrapes without it); ``off``, no
#: ``/metrics`` route.
METRICS_MODES = ("key", "open", "off")

#: Seconds; from a short answer on a GPU to a long one on a busy CPU.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)

_SANE_ID = re.compile(r"[!-~]{1,128}")


def request_id(given: bytes | None) -> str:
    """The request's own ``x-request-id`` when it is 1-128 printable ASCII characters without
    spaces, else a new random one (32 hex digits)."""
    text = given.decode("latin-1") if given else ""
    return text if _SANE_ID.fullmatch(text) else uuid.uuid4().hex


#: Characters a logged path keeps as they are (RFC 3986's unreserved and sub-delims, ``/``,
#: ``:`` and ``@``); the others, ``%``, spaces and line breaks included, are percent-encoded.
_PATH_SAFE = "/:@!$&'()*+,;=-._~"
#: The longest path logged (characters after encoding); a longer one is cut, marked ``...``.
MAX_LOGGED_PATH = 200


def logged_path(path: str) -> str:
    """A request path no route matched, as its log line shows it: percent-encoded, so a
    space or line break in it (sent encoded, decoded by the server) cannot write fields that
    read as another request's; cut to :data:`MAX_LOGGED_PATH` characters."""
    text = quote(path.encode("utf-8", "surrogatepass"), safe=_PATH_SAFE)
    return text if len(text) <= MAX_LOGGED_PATH else text[: MAX_LOGGED_PATH - 3] + "..."


class Telemetry:
    """The metrics of one app (``state``: the app's state, whose ``"service"`` is the
    :class:`~.service.ChatService` once loaded, None before)."""

    def __init__(self, state: dict[str, Any]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()

        def live(read: Any) -> Any:
            return lambda: 0 if (svc := state["service"]) is None else read(svc)

        self.requests = Counter(
            "tokrag_requests",
            "HTTP requests answered, by route and status code",
            ["route", "code"],
            registry=reg,
        )
        Gauge(
            "tokrag_requests_active",
            "Chat requests admitted now (retrieving, waiting or decoding; --max-queue bounds them)",
            registry=reg,
        ).set_function(live(lambda svc: svc.active))
        Gauge(
            "tokrag_requests_waiting",
            "Chat requests queued for a decode and not admitted to it yet",
            registry=reg,
        ).set_function(live(lambda svc: svc.batcher.waiting()))
        Gauge(
            "tokrag_running_rows",
            "Context rows the running decode holds (two per tokrag "
            "request, one per rag or no_rag request)",
            registry=reg,
        ).set_function(live(lambda svc: svc.batcher.running_rows()))
        self.prompt_tokens = Counter(
            "tokrag_prompt_tokens",
            "Prompt tokens of the answered requests (as usage.prompt_tokens counts them)",
            registry=reg,
        )
        self.generated = Counter(
            "tokrag_generated_tokens", "Tokens generated for the answered requests", registry=reg
        )
        self.by_source = Counter(
            "tokrag_generated_tokens_by_source",
            "Generated tokens by the policy that decoded them and their source (agree, rag, pure)",
            ["policy", "source"],
            registry=reg,
        )
        self.ttft = Histogram(
            "tokrag_time_to_first_token_seconds",
            "Streamed requests: from arrival to the first generated token",
            registry=reg,
            buckets=TTFT_BUCKETS,
        )
        self.latency = Histogram(
            "tokrag_e2e_request_latency_seconds",
            "Answered chat requests: from arrival to the last token",
            registry=reg,
            buckets=LATENCY_BUCKETS,
        )

    def answered(self, results: Any, prompt_tokens: int, started: float) -> None:
        """Count one request's finished answer: its decodes (one
        :class:`~tokrag_integrations.GenerationResult` each; several for ``n`` sampled
        choices), which arrived at ``started`` (``time.perf_counter()``) and read
        ``prompt_tokens`` prompt tokens."""
        self.latency.observe(time.perf_counter() - started)
        self.prompt_tokens.inc(prompt_tokens)
        for result in results:
            self.generated.inc(len(result.token_ids))
            policy = result.trace.policy
            for source, n in result.trace.counts().items():
                self.by_source.labels(policy, source).inc(n)

    def first_token(self, started: float) -> None:
        self.ttft.observe(time.perf_counter() - started)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """The metrics and their content type, in the format the ``Accept`` header asks for:
        OpenMetrics (what Prometheus asks for), else Prometheus' text format 0.0.4."""
        from prometheus_client.exposition import choose_encoder

        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class RequestLog:
    """ASGI middleware: every HTTP response carries ``x-request-id`` (the request's own when
    sane, see :func:`request_id`; ``echo_id=False`` leaves the header to a proxy that sets it,
    Ray Serve's) and ``x-tokrag-replica``, is counted in ``tokrag_requests_total`` and gets
    one log line: method, route, status, seconds to its last byte, request id. An exception
    no route handled is logged and answered with an OpenAI-style 500 here, so that it too
    carries the headers. Plain ASGI: streaming and disconnect detection pass through."""

    def __init__(self, app: Any, telemetry: Telemetry, replica: str, echo_id: bool = True) -> None:
        self.app, self.telemetry, self.echo_id = app, telemetry, echo_id
        self.replica = (b"x-tokrag-replica", replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = request_id(dict(scope["headers"]).get(b"x-request-id"))
        headers = [self.replica, *([(b"x-request-id", rid.encode())] if self.echo_id else [])]
        status: int | None = None

        async def send_with_headers(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as exc:
            if status is not None:  # the response is under way: nothing else can be sent
                raise
            from starlette.responses import JSONResponse

            from .refusals import RequestError

            log.error("request %s failed", rid, exc_info=exc)
            message = f"internal error ({type(exc).__name__}); see the server log"
            body = RequestError(message, None, 500, "server_error").to_dict()
            await JSONResponse(body, 500)(scope, receive, send_with_headers)
        finally:
            route = getattr(scope.get("route"), "path", None)
            code = 499 if status is None else status  # none sent: the client left first
            self.telemetry.requests.labels(route or "other", str(code)).inc()
            log.info(
                "%s %s %d %.3fs request_id=%s",
                scope["method"],
                route or logged_path(scope["path"]),
                code,
                time.perf_counter() - started,
                rid,
            )
