"""The ``tokrag`` command line (also ``python -m tokrag_integrations.cli``).

    tokrag ask "Who founded Quillfeather Aerospace?" --docs sample --explain --html trace.html

``main`` and the parser live here; each command in its own module: :mod:`.ask`,
:mod:`.pg` (``ingest``), :mod:`.serve`; shared helpers in :mod:`.console`. A subcommand is
an ``add_*_parser(subparsers)`` function that sets ``func`` (``(args) -> int``);
:data:`SUBCOMMANDS` lists them, :func:`register_subcommand` adds one, and an installed
package adds its own through the ``tokrag.commands`` entry-point group
(:func:`plugin_commands`: the research harness's ``eval`` and ``bench`` come that way, from
``tokrag_eval``, installed with the ``eval`` extra). Importing this is cheap (torch loads
when a command runs); user errors end with a one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from .ask import add_parser as add_ask_parser
from .console import EXIT_USAGE, AddParser, _consoles, _print_warning, parse_option
from .pg import EXIT_DATABASE, _database_errors, add_ingest_parser, warn_password_on_command_line
from .serve import add_parser as add_serve_parser

__all__ = [
    "main", "build_parser", "register_subcommand", "plugin_commands", "SUBCOMMANDS", "parse_option",
]

#: The entry-point group an installed package names its ``add_parser`` functions in
#: (``[project.entry-points."tokrag.commands"]`` in its pyproject.toml).
COMMANDS_GROUP = "tokrag.commands"

#: The subcommands, each an ``add_*_parser(subparsers)`` function. Append to add one.
SUBCOMMANDS: list[AddParser] = [
    add_ask_parser,
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


def plugin_commands() -> list[AddParser]:
    """The ``add_parser`` functions installed packages declare in the ``tokrag.commands``
    entry-point group, by entry-point name. One that cannot be loaded (a missing dependency)
    is left out with a one-sentence warning: the other commands still run."""
    from importlib.metadata import entry_points

    found = []
    for ep in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        try:
            found.append(ep.load())
        except Exception as exc:  # a broken plugin must not take ``tokrag ask`` down with it
            warnings.warn(
                f"the command {ep.name!r} ({ep.value}) could not be loaded and is left out: "
                f"{type(exc).__name__}: {exc}",
                stacklevel=2,
            )
    return found


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
    for add_parser in [*SUBCOMMANDS, *plugin_commands()]:
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tokrag`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    ``ValueError`` and ``FileNotFoundError`` raised while a command runs are user errors:
    they print ``tokrag: error: <message>`` to stderr and return 2. Python warnings raised
    meanwhile (e.g. a document that is not UTF-8) are printed as one-line warnings.
    """
    from ..config import CacheDirError

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
        args = build_parser().parse_args(argv)  # a command that cannot load: one warning line
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for records
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
