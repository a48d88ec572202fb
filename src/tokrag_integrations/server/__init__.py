"""Serve a loaded model over HTTP: an OpenAI-compatible chat completions API (``tokrag serve``).

Needs the ``serve`` extra (``pip install 'tokrag-integrations[serve]'``: FastAPI and uvicorn);
scale-out on Ray Serve needs the ``ray`` extra. Importing this package is cheap: FastAPI,
uvicorn and Ray load only when an app is built or served.

* :func:`create_app`, :func:`serve` — the FastAPI app, and uvicorn running it (:mod:`.app`).
* :class:`ChatService`, :class:`ServeConfig` — the model side and the settings (:mod:`.service`).
* :func:`parse_chat_request` — requests (:mod:`.schemas`); :class:`Limits`, :class:`RequestError` — refusals (:mod:`.refusals`).
* :func:`ray_deployment`, :func:`run_ray` — the app on Ray Serve (:mod:`.ray_app`).
"""

from __future__ import annotations

from .app import create_app, serve
from .ray_app import ray_deployment, run_ray
from .refusals import Limits, RequestError
from .schemas import parse_chat_request
from .service import ChatService, ServeConfig

__all__ = [
    "ChatService",
    "Limits",
    "RequestError",
    "ServeConfig",
    "create_app",
    "parse_chat_request",
    "ray_deployment",
    "run_ray",
    "serve",
]
