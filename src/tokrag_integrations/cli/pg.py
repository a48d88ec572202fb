"""``tokrag ingest`` and the Postgres side of ``tokrag ask --store postgres``.

    tokrag ingest docs/ handbook.pdf --table handbook            # embedded Postgres
    tokrag ingest docs/ --dsn postgresql://rag:...@db:5432/rag    # or TOKRAG_PG_DSN=...
    tokrag ask "How many approvals?" --store postgres --table handbook --filter format=md

Exit status of ``ingest``: 0 when every file was ingested or unchanged, 1 when some file
was skipped (each is listed with its reason), 2 for usage errors (bad table name, missing
path), 3 when the database cannot be reached, started or used (a missing privilege, a table
of that name that is not tokrag's, a bad ``TOKRAG_PG_CONNECT_TIMEOUT``; one sentence, never
a password). Files deleted from an ingested folder keep their chunks unless ``--prune`` is
given; the summary counts them as stale (or pruned).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from ..defaults import CHUNK_CHARS, CHUNK_OVERLAP

#: Some files were skipped (listed in the summary).
EXIT_PARTIAL = 1
#: The database could not be reached or started.
EXIT_DATABASE = 3


def _database_errors() -> tuple[type[BaseException], ...]:
    from ..postgres.dsn import PostgresConnectionError, PostgresSetupError

    return (PostgresConnectionError, PostgresSetupError, LookupError)


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--dsn``, ``--table``, ``--embed-model``, ``--data-dir`` (and nothing else)."""
    from ..postgres.embedded import DSN_ENV
    from ..postgres.layout import DEFAULT_TABLE

    parser.add_argument(
        "--dsn",
        metavar="URL",
        help=f"Postgres with pgvector, e.g. postgresql://USER:PASSWORD@HOST:5432/DB (default: "
        f"${DSN_ENV}, else an embedded server in the per-user data folder)",
    )
    parser.add_argument(
        "--table",
        default=DEFAULT_TABLE,
        help=f"table name (LlamaIndex stores it as data_<table>; default {DEFAULT_TABLE})",
    )
    parser.add_argument(
        "--embed-model",
        metavar="FOLDER",
        help="local sentence-transformers model folder (default: the packaged all-MiniLM-L6-v2)",
    )
    parser.add_argument(
        "--data-dir",
        metavar="FOLDER",
        help="data folder of the embedded server (default: $TOKRAG_DATA_DIR/pg or "
        "~/.local/share/tokrag/pg; /var/lib/tokrag/pg as root)",
    )


def warn_password_on_command_line(dsn: str | None) -> None:
    """Warn when ``--dsn`` holds a password: every local user can read a command line (``ps``)."""
    from ..postgres.dsn import PostgresConnectionError, dsn_params
    from ..postgres.embedded import DSN_ENV

    if not dsn:
        return
    try:
        password = dsn_params(dsn).get("password")
    except PostgresConnectionError:  # reported when the command connects
        return
    if password:
        warnings.warn(
            "--dsn holds a password, which every local user can read in the process list "
            f"(ps); set {DSN_ENV} instead, or keep the password in a pgpass file (~/.pgpass, "
            "mode 0600) or a connection service file (pg_service.conf, --dsn service=NAME).",
            UserWarning,
            stacklevel=2,
        )


def _megabytes(text: str) -> float:
    from ..retrieval.opener import max_file_bytes

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MB, got {text!r}") from None
    try:
        max_file_bytes(value)  # the opener's own rule for a cap
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number of MB above 0, got {text!r}") from None
    return value


def add_max_file_argument(parser: argparse.ArgumentParser, what: str = "") -> None:
    """Add ``--max-file-mb`` (the size cap of the one document opener)."""
    from ..retrieval import DEFAULT_MAX_FILE_MB

    parser.add_argument(
        "--max-file-mb",
        type=_megabytes,
        default=None,
        metavar="MB",
        help=f"{what}skip (and report) files bigger than this many MB (default "
        f"{DEFAULT_MAX_FILE_MB:g})",
    )


def add_filter_argument(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--filter key=value`` and ``--search`` (for ``ask --store postgres``)."""
    parser.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="metadata filter (repeatable, all must hold; the same key twice with = means "
        "either value), e.g. --filter file_name=leave_policy.md; also KEY!=V, KEY>=N, KEY<=N, "
        "KEY>N, KEY<N (numbers compare as numbers) and KEY~=V (a list holding V, or text "
        "containing it)",
    )
    parser.add_argument(
        "--search",
        choices=("vector", "text", "hybrid"),
        default="vector",
        help="with --store postgres: vector (embedding similarity, default), text (Postgres "
        "full-text search) or hybrid (reciprocal rank fusion of both: finds exact "
        "identifiers such as part numbers and error codes)",
    )


def add_ingest_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tokrag ingest PATH... [--dsn] [--table] [--embed-model] [--target]``."""
    p = subparsers.add_parser(
        "ingest",
        help="chunk, embed and store documents in Postgres + pgvector",
        description="Chunk, embed and write files into a pgvector table. Unchanged files are "
        "skipped, changed files replace their chunks, and each file is written in one "
        "transaction.",
    )
    from ..retrieval import supported_types

    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help=f"files or folders of documents: {supported_types()} (as for `ask --docs`)",
    )
    add_store_arguments(p)
    p.add_argument(
        "--target",
        choices=("llamaindex", "langchain"),
        default="llamaindex",
        help="table layout: llamaindex (default; LangChain reads it too) or langchain "
        "(langchain-postgres' own columns, LangChain only)",
    )
    p.add_argument("--chunk-size", type=int, default=CHUNK_CHARS, help="max characters per chunk")
    p.add_argument("--overlap", type=int, default=CHUNK_OVERLAP, help="characters shared by chunks")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (or, with stderr redirected, no line per file)",
    )
    p.add_argument(
        "--prune",
        action="store_true",
        help="delete the chunks of files that are stored from the given folders but no longer "
        "exist there (default: keep them, still retrievable, and count them as stale)",
    )
    p.add_argument(
        "--text-search-config",
        default="english",
        metavar="NAME",
        help="text search configuration of a new table's full-text column (default english; "
        "any of the server's pg_ts_config, e.g. simple, german)",
    )
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="add the full-text column (for --search text/hybrid) to an existing table that "
        "has none; rewrites the table once",
    )
    p.add_argument(
        "--follow-links",
        action="store_true",
        help="also read files through symbolic links that leave the given folders, or the "
        "folder of a file named directly (a warning names each one; default: report them as "
        "skipped)",
    )
    add_max_file_argument(p)
    p.set_defaults(func=cmd_ingest)


def cmd_ingest(args: argparse.Namespace) -> int:
    """Run ``tokrag ingest``; prints the summary to stdout, errors to stderr."""
    from ..postgres.ingestion import FileReport, ingest
    from ..retrieval import LARGE_INPUT_BYTES, printable

    # On a terminal tqdm draws a bar; redirected (a log, CI), one plain line per file instead,
    # so a long ingest is never silent.
    plain = not args.no_progress and not sys.stderr.isatty()

    def note(text: str) -> None:
        print(f"ingest: {text}", file=sys.stderr, flush=True)

    def say(item: FileReport) -> None:
        chunks = f" ({item.chunks} chunks)" if item.chunks else ""
        note(f"{item.status} {printable(item.path)}{chunks}")

    def starting(path: Path) -> None:
        try:
            size = path.stat().st_size
        except OSError:  # reported with the file
            return
        if size > LARGE_INPUT_BYTES:
            note(
                f"reading {printable(path)} ({size / 2**20:.1f} MB); a big file takes minutes to "
                "chunk and embed…"
            )

    if plain:
        note(f"opening the database and the embedder, then {len(args.paths)} path(s)…")
    try:
        summary = ingest(
            [Path(p).expanduser() for p in args.paths],
            dsn=args.dsn,
            table=args.table,
            embed_model=args.embed_model,
            target=args.target,
            max_chars=args.chunk_size,
            overlap=args.overlap,
            progress=not args.no_progress and sys.stderr.isatty(),
            data_dir=args.data_dir,
            prune=args.prune,
            follow_links=args.follow_links,
            on_file=say if plain else None,
            on_start=starting if plain else None,
            max_file_mb=args.max_file_mb,
            text_search_config=args.text_search_config,
            upgrade=args.upgrade,
        )
    except _database_errors() as exc:
        print(f"tokrag: error: {exc}", file=sys.stderr)
        return EXIT_DATABASE
    print(summary.to_text())
    return EXIT_PARTIAL if summary.failed else 0
