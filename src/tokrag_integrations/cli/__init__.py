"""The ``tokrag`` command line (also ``python -m tokrag_integrations.cli``).

    tokrag ask "Who founded Quillfeather Aerospace?" --docs sample --explain --html trace.html

This module holds ``main`` and the parser; each command group lives in its own module next
to it: :mod:`.ask` (``tokrag ask``), :mod:`.eval` (``tokrag eval``), :mod:`.pg` (``tokrag ingest`` and the ``--store
postgres`` options of ``ask``), :mod:`.gate` (``ask --gate``), :mod:`.serve` (``tokrag
serve``); ``tokrag bench`` is :mod:`..bench`; the helpers they share are in :mod:`._common`.

Each subcommand is one ``add_*_parser(subparsers)`` function that adds its parser and sets
``func`` (a ``(args) -> int`` handler) as a default; :data:`SUBCOMMANDS` lists them. A new
subcommand (``bench``, ``eval``, ``ingest``...) is a new pair of functions added to that list,
or registered from another module with :func:`register_subcommand`.

Importing this module is cheap: torch, transformers and the retrievers load only when a
command runs. User errors (``ValueError`` / ``FileNotFoundError`` from the library) end the
command with a one-line message and exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._common import (  # noqa: F401 - importable from here as before
    _CONTROL_PICTURES,
    _STREAM_STYLES,
    EXIT_USAGE,
    SAMPLE_DOCS,
    AddParser,
    _check_output_path,
    _consoles,
    _positive_int,
    _print_warning,
    _resolve_docs,
    _SanitizedRenderable,
    _short_source,
    _Status,
    _stop_strings,
    _visible_controls,
    _VisibleControls,
    parse_option,
)
from .ask import (  # noqa: F401 - importable from here as before
    _check_before_loading,
    _placement,
    _print_sources,
    _retrieve,
    cmd_ask,
)
from .ask import add_parser as add_ask_parser

__all__ = ["main", "build_parser", "register_subcommand", "SUBCOMMANDS", "parse_option"]

# ============================================================================ parser
#: The subcommands, each an ``add_*_parser(subparsers)`` function. Append to add one.
SUBCOMMANDS: list[AddParser] = [add_ask_parser]


def _lazy(module: str, func: str) -> AddParser:
    """A subcommand defined in another module of the package (``module`` relative to
    ``tokrag_integrations``), imported only when the parser is built."""

    def add(subparsers: Any) -> Any:
        import importlib

        package = __name__.rpartition(".")[0]
        return getattr(importlib.import_module(f"{package}.{module}"), func)(subparsers)

    add.__name__ = f"{module}.{func}"
    return add


SUBCOMMANDS += [
    _lazy("bench", "add_parser"),
    _lazy("cli.eval", "add_parser"),
    _lazy("cli.pg", "add_ingest_parser"),
    _lazy("cli.serve", "add_parser"),
]


def register_subcommand(add_parser: AddParser) -> AddParser:
    """Add a subcommand defined elsewhere; usable as a decorator.

    ``add_parser(subparsers)`` must add its parser and ``set_defaults(func=handler)``, where
    ``handler(args) -> int`` returns the exit status.
    """
    if add_parser not in SUBCOMMANDS:
        SUBCOMMANDS.append(add_parser)
    return add_parser


def build_parser() -> argparse.ArgumentParser:
    """The ``tokrag`` argument parser with every registered subcommand."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="tokrag",
        description="Token-level benefit/detriment harmonisation for RAG on local models.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tokrag`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``ValueError`` and ``FileNotFoundError`` raised while a command runs are user errors:
    they print ``tokrag: error: <message>`` to stderr and return 2. Python warnings raised
    meanwhile (e.g. a document that is not UTF-8) are printed as one-line warnings.
    """
    from ..paths import CacheDirError

    parser = build_parser()
    args = parser.parse_args(argv)
    _, err = _consoles()
    shown: set[str] = set()

    def show(message: Warning | str, *_: Any, **__: Any) -> None:
        text = str(message)
        if text not in shown:
            shown.add(text)
            _print_warning(err, text)

    previous = warnings.showwarning
    warnings.showwarning = show  # type: ignore[assignment]
    try:
        if getattr(args, "dsn", None):
            from .pg import warn_password_on_command_line

            warn_password_on_command_line(args.dsn)
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, CacheDirError) as exc:
        message = str(exc) or type(exc).__name__
        if isinstance(exc, FileNotFoundError) and exc.filename and str(exc.filename) not in message:
            message = f"{message}: {exc.filename}"
        print(f"tokrag: error: {' '.join(message.split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tokrag: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # Database problems (unreachable server, missing pgvector, unknown table) are the
        # user's to fix, not tracebacks; their messages never contain credentials.
        if not _is_database_error(exc):
            raise
        print(f"tokrag: database error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 3
    finally:
        warnings.showwarning = previous


def _is_database_error(exc: BaseException) -> bool:
    if "tokrag_integrations.postgres.dsn" not in sys.modules:
        return False
    from ..postgres.dsn import PostgresConnectionError, PostgresSetupError

    return isinstance(exc, (PostgresConnectionError, PostgresSetupError, LookupError))

