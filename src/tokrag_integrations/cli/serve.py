"""``tokrag serve``: an OpenAI-compatible chat completions server (one process, or Ray Serve).

    tokrag serve --port 8000                                  # localhost, the packaged model
    tokrag serve --store postgres --table handbook --top-k 5  # retrieve when no documents
    tokrag serve --ray --replicas 2                           # Ray Serve, one model a replica

See docs/serving.md for every setting.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..defaults import ANSWER_STOP, MAX_NEW_TOKENS, TOP_K
from .console import add_model_arguments, check_policy, parse_option, positive_int

__all__ = ["add_parser", "cmd_serve", "config_from_args"]


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tokrag serve``."""
    from ..policies import available_policies
    from .pg import add_store_arguments

    p = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible chat completions)",
        description="Serve a local model over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions with 'documents' and 'tokrag' extra fields, /v1/models, "
        "/health). Binds to 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    add_model_arguments(p)
    p.add_argument("--policy", default="tokrag",
                   help=f"policy of requests that name none: {', '.join(available_policies())}")
    p.add_argument("--option", action="append", default=[], type=parse_option,
                   metavar="KEY=VALUE", help="a default policy option (repeatable)")
    p.add_argument("--max-new-tokens", type=positive_int, default=MAX_NEW_TOKENS,
                   help=f"max_tokens of requests that give none (default {MAX_NEW_TOKENS})")
    p.add_argument("--no-stop", action="store_true",
                   help="requests without 'stop' get no stop strings (default: a blank line or "
                   "a line starting with '#', as `tokrag ask`)")
    limits = p.add_argument_group("limits")
    limits.add_argument("--max-tokens-limit", type=positive_int, default=512,
                        help="largest max_tokens a request may ask for (default 512)")
    limits.add_argument("--max-documents", type=positive_int, default=32,
                        help="most documents in one request (default 32)")
    limits.add_argument("--max-n", type=positive_int, default=8,
                        help="most choices (n) in one request (default 8)")
    limits.add_argument("--max-body-bytes", type=positive_int, default=1_000_000,
                        help="largest request body (default 1000000)")
    limits.add_argument("--max-queue", type=positive_int, default=64,
                        help="requests admitted at once; one more gets 429 (default 64)")
    limits.add_argument("--api-key", default=None,
                        help="bearer token required on /v1/* and /openapi.json (default: "
                             "$TOKRAG_API_KEY; none); an empty key, or one with surrounding "
                             "whitespace or characters outside printable ASCII, is refused")
    limits.add_argument("--metrics", choices=("key", "open", "off"), default="key",
                        help="GET /metrics (Prometheus): 'key' needs the API key when one is "
                             "set, as /v1/* (default); 'open' never does; 'off' serves none")
    batching = p.add_argument_group("batching")
    batching.add_argument("--max-batch", type=positive_int, default=None,
                          help="largest batch of concurrent requests decoded together")
    batching.add_argument("--batch-wait-ms", type=_non_negative_float, default=None,
                          help="how long a request waits for companions before decoding")
    batching.add_argument("--max-rows", type=positive_int, default=None,
                          help="most context rows a running decode holds (two per tokrag request; "
                               "default 32); a request that does not fit waits")
    batching.add_argument("--max-positions", type=positive_int, default=None,
                          help="most key/value positions a running decode may reach "
                               "(rows x (prompt + max_tokens); default 65536)")
    batching.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                          help="most prompt tokens prefilled at one step of a running decode "
                               "(default: no bound): a burst of requests then joins over several "
                               "steps, and its first requests get their first token sooner")
    batching.add_argument("--no-continuous-batching", dest="continuous", action="store_false",
                          help="a request arriving while a decode runs waits for it to finish "
                               "instead of joining it at the next step")
    store = p.add_argument_group("retrieval (when a request has no documents)")
    store.add_argument("--store", choices=("postgres",), default=None,
                       help="retrieve from an ingested Postgres table")
    store.add_argument("--top-k", type=positive_int, default=TOP_K,
                       help=f"chunks retrieved per question (default {TOP_K})")
    store.add_argument("--sources-relative-to", metavar="FOLDER", default=None,
                       help="give each answer's sources relative to FOLDER (the folder that was "
                       "ingested), those outside it as their file name alone (default: the "
                       "absolute paths ingest stored)")
    add_store_arguments(store)  # --dsn, --table, --embed-model, --data-dir
    ray = p.add_argument_group("Ray Serve (the ray extra)")
    ray.add_argument("--ray", action="store_true",
                     help="deploy on Ray Serve (a local Ray instance, or RAY_ADDRESS / --ray-address)")
    ray.add_argument("--ray-address", default=None,
                     help="Ray cluster to join, e.g. ray://head:10001 or auto (default: local)")
    ray.add_argument("--replicas", type=positive_int, default=1,
                     help="replicas, one model each (default 1)")
    ray.add_argument("--max-ongoing-requests", type=positive_int, default=None,
                     help="requests Ray sends one replica at once (default: --max-queue)")
    ray.add_argument("--autoscale", metavar="MIN:MAX", default=None,
                     help="autoscale between MIN and MAX replicas instead of --replicas")
    ray.add_argument("--target-ongoing-requests", type=float, default=None,
                     help="autoscaling target of ongoing requests a replica (Ray's default: 2)")
    ray.add_argument("--num-cpus", type=float, default=1.0,
                     help="CPUs Ray reserves for each replica (default 1)")
    ray.add_argument("--num-gpus", type=float, default=0.0,
                     help="GPUs Ray reserves for each replica (default 0)")
    p.set_defaults(func=cmd_serve)


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~tokrag_integrations.server.ServeConfig` the flags describe."""
    from dataclasses import fields

    from ..server.refusals import Limits
    from ..server.service import ServeConfig

    same = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if hasattr(args, f.name)}
    return ServeConfig(
        **same,
        policy_options=dict(args.option),
        stop=None if args.no_stop else ANSWER_STOP,
        limits=Limits(args.max_tokens_limit, args.max_documents, max_body_bytes=args.max_body_bytes,
                      max_n=args.max_n),
        batch_wait_s=None if args.batch_wait_ms is None else args.batch_wait_ms / 1000,
    )


def _autoscale(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if not sep or not low.isdigit() or not high.isdigit() or int(high) < max(int(low), 1):
        raise ValueError(f"--autoscale takes MIN:MAX with 0 <= MIN <= MAX, MAX >= 1; got {text!r}")
    return int(low), int(high)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``tokrag serve`` until interrupted."""
    check_policy(args.policy, dict(args.option))
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.api_key:
        import warnings

        warnings.warn(
            "--api-key is visible to every local user in the process list (ps); set "
            "$TOKRAG_API_KEY instead",
            UserWarning,
            stacklevel=2,
        )
    if args.sources_relative_to is not None and args.store is None:
        raise ValueError("--sources-relative-to applies to --store postgres; give both")
    config = config_from_args(args)
    config.resolved_api_key()  # a key no client could send fails before the model loads
    if args.ray:
        from ..server.ray_app import run_ray

        run_ray(
            config, host=args.host, port=args.port, replicas=args.replicas,
            address=args.ray_address, max_ongoing_requests=args.max_ongoing_requests,
            autoscale=_autoscale(args.autoscale),
            target_ongoing_requests=args.target_ongoing_requests,
            num_cpus=args.num_cpus, num_gpus=args.num_gpus, blocking=True,
        )
        return 0
    from ..server.app import serve

    serve(config, host=args.host, port=args.port)
    return 0
