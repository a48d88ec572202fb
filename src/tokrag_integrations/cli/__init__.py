"""The ``tokrag`` command line (also ``python -m tokrag_integrations.cli``).

    tokrag ask "Who founded Quillfeather Aerospace?" --docs sample --explain --html trace.html

``main`` and the parser live here; each command in its own module: :mod:`.ask`,
:mod:`.eval` (also ``bench``), :mod:`.pg` (``ingest``), :mod:`.serve`; shared helpers in
:mod:`.console`. A subcommand is an ``add_*_parser(subparsers)`` function that sets
``func`` (``(args) -> int``); :data:`SUBCOMMANDS` lists them, :func:`register_subcommand`
adds one. Importing this is cheap (torch loads when a command runs); user errors end with
a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .ask import add_parser as add_ask_parser
from .console import EXIT_USAGE, AddParser, _consoles, _print_warning, parse_option
from .eval import add_bench_parser
from .eval import add_parser as add_eval_parser
from .pg import EXIT_DATABASE, _database_errors, add_ingest_parser, warn_password_on_command_line
from .serve import add_parser as add_serve_parser

__all__ = ["main", "build_parser", "register_subcommand", "SUBCOMMANDS", "parse_option"]

#: The subcommands, each an ``add_*_parser(subparsers)`` function. Append to add one.
SUBCOMMANDS: list[AddParser] = [
    add_ask_parser,
    add_bench_parser,
    add_eval_parser,
    add_ingest_parser,
    add_serve_parser,
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
    from ..config import CacheDirError

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for records
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
        warn_password_on_command_line(getattr(args, "dsn", None))
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
        if "tokrag_integrations.postgres.dsn" not in sys.modules:
            raise
        if not isinstance(exc, _database_errors()):
            raise
        print(f"tokrag: database error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_DATABASE
    finally:
        warnings.showwarning = previous
