"""Serve a loaded model over HTTP: an OpenAI-compatible chat completions API (``tokrag serve``).

Needs the ``serve`` extra (``pip install 'tokrag-integrations[serve]'``: FastAPI and uvicorn);
scale-out on Ray Serve needs the ``ray`` extra. Importing this package is cheap.

* :func:`create_app` — the FastAPI app (:mod:`.app`).
* :class:`ChatService`, :class:`ServeConfig` — the model side and the settings (:mod:`.service`).
* :func:`serve` — load, then run uvicorn (what ``tokrag serve`` does).
* :func:`ray_deployment` — the same app as a Ray Serve deployment (:mod:`.ray_app`).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "create_app": "app",
    "ChatService": "service",
    "ServeConfig": "service",
    "Limits": "schemas",
    "RequestError": "schemas",
    "parse_chat_request": "schemas",
    "serve": "runner",
    "ray_deployment": "ray_app",
    "run_ray": "ray_app",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
