"""``tokrag serve`` in one process: uvicorn running :func:`~.app.create_app`."""

from __future__ import annotations

import ipaddress
import warnings
from typing import Any

from .service import API_KEY_ENV, ChatService, ServeConfig

__all__ = ["serve", "is_local", "require_serve_extra"]


def require_serve_extra() -> None:
    """Raise an install hint when FastAPI or uvicorn is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"tokrag serve needs FastAPI and uvicorn ({exc.name} is missing): "
            "pip install 'tokrag-integrations[serve]'"
        ) from None


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
    """Start uvicorn on ``host:port``; the model loads in the background (``/health`` is 503
    until it is ready). Blocks until the server stops.

    SIGTERM ends it as Ctrl-C does: uvicorn shuts down, then raises the signal again under
    the handler it found, which is set here, from the main thread, to exit through
    ``atexit`` (the store, opened in the loading thread, cannot set it), so an embedded
    Postgres is stopped and its handle cleared (:func:`~..postgres.embedded.stop_on_sigterm`).
    """
    require_serve_extra()
    import uvicorn

    from ..postgres.embedded import stop_on_sigterm
    from .app import create_app

    warn_if_open(host, config)
    stop_on_sigterm()
    app = create_app(loader=lambda: ChatService.load(config), config=config)
    uvicorn.run(app, host=host, port=port, log_level=log_level, **uvicorn_kwargs)
