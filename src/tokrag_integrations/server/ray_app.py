"""The same app on Ray Serve: N replicas, one model each (``tokrag serve --ray``).

    from tokrag_integrations.server import ServeConfig, ray_deployment
    from ray import serve
    serve.run(ray_deployment(ServeConfig(), replicas=2), route_prefix="/")

Each replica is a Ray actor that loads the model in its constructor and serves
:func:`~.app.create_app` through ``serve.ingress``; Ray's proxy spreads requests over the
replicas. Needs the ``ray`` extra (``pip install 'tokrag-integrations[ray]'``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .service import ServeConfig

__all__ = ["ray_deployment", "run_ray", "require_ray"]


def require_ray() -> Any:
    """``ray.serve``, or an install hint."""
    try:
        from ray import serve
    except ImportError:
        raise ImportError(
            "tokrag serve --ray needs Ray Serve: pip install 'tokrag-integrations[ray]'"
        ) from None
    return serve


class TokRAGReplica:
    """One Ray Serve replica: a loaded model behind the FastAPI app (see :func:`ray_deployment`)."""

    def __init__(self, config: ServeConfig, torch_threads: int | None = 1) -> None:
        if torch_threads:
            # Several replicas share a machine's cores: more threads than cores slows torch
            # down by orders of magnitude.
            import torch

            torch.set_num_threads(int(torch_threads))
        from .app import create_app
        from .service import ChatService

        # Ray's proxy sets x-request-id (the client's, else its own) on requests and responses.
        self._app = create_app(ChatService.load(config), echo_request_id=False)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def ray_deployment(
    config: ServeConfig,
    *,
    replicas: int = 1,
    max_ongoing_requests: int | None = None,
    autoscale: tuple[int, int] | None = None,
    target_ongoing_requests: float | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    torch_threads: int | None = 1,
    name: str = "tokrag",
) -> Any:
    """A bound Ray Serve application serving ``config`` (pass it to ``serve.run``).

    Args:
        replicas: fixed number of replicas (ignored with ``autoscale``).
        max_ongoing_requests: requests Ray hands one replica at once (default
            ``config.max_queue``, so the replica's own 429 and Ray's back-pressure agree).
        autoscale: ``(min_replicas, max_replicas)``: Ray adds or removes replicas to keep
            about ``target_ongoing_requests`` requests on each.
        num_cpus / num_gpus: resources Ray reserves for each replica.
        torch_threads: torch threads in each replica (None: torch's default).
    """
    serve = require_ray()
    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": max_ongoing_requests or config.max_queue,
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
    }
    if autoscale is not None:
        auto: dict[str, Any] = {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                "initial_replicas": max(autoscale[0], 1)}
        if target_ongoing_requests is not None:
            auto["target_ongoing_requests"] = target_ongoing_requests
        options["autoscaling_config"] = auto
    else:
        options["num_replicas"] = replicas
    deployment = serve.deployment(serve.ingress()(TokRAGReplica), **options)
    return deployment.bind(config, torch_threads)


def run_ray(
    config: ServeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    blocking: bool = False,
    **deployment_kwargs: Any,
) -> Any:
    """Start (or join) Ray, start Serve's HTTP proxy on ``host:port`` and deploy
    (``deployment_kwargs``: those of :func:`ray_deployment`); with ``blocking`` wait until
    interrupted, then shut Serve down. Returns the app's handle."""
    serve = require_ray()
    import ray

    from .app import warn_if_open

    warn_if_open(host, config)
    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address)
        else:  # a local instance: say how many CPUs (Ray's guess may count the host's)
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False)
    serve.start(http_options={"host": host, "port": port})
    handle = serve.run(ray_deployment(config, **deployment_kwargs), name="tokrag", route_prefix="/")
    if blocking:
        print(f"tokrag: serving on http://{host}:{port} (Ray Serve); Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            serve.shutdown()
    return handle
