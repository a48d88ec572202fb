"""Where the Postgres comes from: a connection string, or an embedded server from ``pgserver``.

Resolution order (:func:`resolve_dsn`):

1. an explicit ``dsn`` argument (the CLI's ``--dsn``);
2. the environment variable ``TOKRAG_PG_DSN``;
3. otherwise an embedded PostgreSQL 16 + pgvector from the ``pgserver`` package, started on
   first use in a per-user data folder and stopped when the last process using it exits
   normally (the data stays, so the next run reuses it). A killed process leaves it running
   until the next process using the folder exits (see :func:`prune_stale_handles`).

With 1 or 2 nothing is started. Connection strings are only ever shown through
:func:`mask_dsn` (``postgresql://alice:***@db:5432/rag``), and errors raised here are
scrubbed of the password.

The embedded server lives in :mod:`.embedded` (its data folder, the root-user caveat, and
why no other local user can reach it), connection strings in :mod:`.dsn`, the errors in
:mod:`.errors`; this module re-exports their public names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import config
from .dsn import (  # noqa: F401 - re-exported: this was their module
    _scrub,
    _secrets_of,
    database_errors,
    dsn_params,
    libpq_conninfo,
    mask_dsn,
    query_error,
    sqlalchemy_url,
)
from .embedded import (  # noqa: F401 - re-exported: this was their module
    _SERVERS,
    _SERVERS_LOCK,
    DATA_DIR_ENV,
    DSN_ENV,
    HANDLE_FILE,
    _socket_folder,
    default_data_dir,
    prune_stale_handles,
    start_again_if_stopped,
    start_embedded,
)
from .errors import (  # noqa: F401 - re-exported: this was their module
    PostgresConnectionError,
    PostgresQueryError,
    PostgresSetupError,
    is_driver_error,
    sqlstate_of,
)

__all__ = [
    "DEFAULT_TABLE",
    "PostgresConnectionError",
    "PostgresQueryError",
    "PostgresSetupError",
    "ResolvedDatabase",
    "check_connection",
    "connect_timeout",
    "default_data_dir",
    "dsn_params",
    "is_reserved_word",
    "mask_dsn",
    "prune_stale_handles",
    "resolve_dsn",
    "sqlalchemy_url",
    "start_embedded",
    "validate_table_name",
]

#: Table name used when none is given (LlamaIndex stores it as ``data_<name>``).
DEFAULT_TABLE = "tokrag_docs"
#: Environment variable: seconds to wait for a connection (fail fast on a wrong host).
CONNECT_TIMEOUT_ENV = config.PG_CONNECT_TIMEOUT
DEFAULT_CONNECT_TIMEOUT_S = config.DEFAULT_PG_CONNECT_TIMEOUT_S

# LlamaIndex creates ``data_<name>`` and indexes ``data_<name>_embedding_idx``; Postgres
# silently truncates identifiers past 63 bytes, so the name is kept well under that.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")
#: PostgreSQL 16 keywords that cannot name a table unquoted, beyond SQLAlchemy's list of its
#: reserved words (``pg_get_keywords()`` categories R and T; a test compares with the server).
_MORE_RESERVED = frozenset({"collation", "concurrently", "lateral", "system_user", "tablesample"})

def connect_timeout() -> int:
    """Seconds to wait for a connection: ``$TOKRAG_PG_CONNECT_TIMEOUT`` (default 5).

    Read when a connection is made, so a bad value fails the database commands with a
    sentence instead of breaking every command at import.

    Raises:
        PostgresSetupError: The value is not a positive number of seconds.
    """
    try:
        return config.pg_connect_timeout()
    except config.ConfigError as exc:
        raise PostgresSetupError(str(exc)) from None


def validate_table_name(table: str) -> str:
    """The table name, lower-cased, or a ``ValueError`` explaining the allowed form.

    Table names end up in DDL that cannot take bind parameters (LlamaIndex builds
    ``CREATE INDEX ... ON data_<name>`` with string formatting), so only plain ASCII
    identifiers are accepted: a letter or underscore, then letters, digits and underscores,
    at most 40 characters. Quotes, semicolons, spaces, dashes and non-ASCII letters are
    rejected rather than escaped. (A reserved word such as ``user`` passes here: LlamaIndex
    stores it as ``data_user``; LangChain's layout, which uses the name itself, refuses it,
    see :func:`is_reserved_word`.)
    """
    if not isinstance(table, str) or not _TABLE_RE.fullmatch(table):
        raise ValueError(
            f"Invalid table name {table!r}: use 1-40 ASCII letters, digits and underscores, "
            "starting with a letter or underscore (e.g. 'tokrag_docs')."
        )
    return table.lower()


def is_reserved_word(name: str) -> bool:
    """Whether ``name`` cannot be a table name in SQL unquoted (``user``, ``order``...)."""
    from sqlalchemy.dialects.postgresql.base import RESERVED_WORDS

    return name.lower() in RESERVED_WORDS or name.lower() in _MORE_RESERVED


# ============================================================================ resolution
@dataclass
class ResolvedDatabase:
    """A usable connection string and where it came from."""

    dsn: str
    """Connection URL (contains the password: never print it, use :attr:`masked`)."""
    origin: str
    """``"argument"``, ``"environment"`` or ``"embedded"``."""
    server: Any = None
    """The ``pgserver`` handle for the embedded server (keeps it alive), else ``None``."""

    @property
    def masked(self) -> str:
        """The connection string with its password hidden."""
        return mask_dsn(self.dsn)

    def __repr__(self) -> str:
        return f"ResolvedDatabase(dsn={self.masked!r}, origin={self.origin!r})"


def resolve_dsn(dsn: str | None = None, *, data_dir: str | Path | None = None) -> ResolvedDatabase:
    """Pick the database: ``dsn``, else ``$TOKRAG_PG_DSN``, else the embedded server.

    Raises:
        PostgresSetupError: ``$TOKRAG_PG_CONNECT_TIMEOUT`` is not a number of seconds
            (checked here, before any model is loaded), or the embedded server cannot start.
    """
    connect_timeout()
    if dsn:
        return ResolvedDatabase(dsn=dsn, origin="argument")
    env = config.pg_dsn()
    if env:
        return ResolvedDatabase(dsn=env, origin="environment")
    uri, server = start_embedded(data_dir)
    return ResolvedDatabase(dsn=uri, origin="embedded", server=server)


def connect(dsn: str, **kwargs: Any) -> Any:
    """A psycopg 3 connection with pgvector registered; errors are scrubbed of the password.

    Raises:
        PostgresConnectionError: The server is unreachable, refuses the login, or lacks the
            ``vector`` extension.
    """
    import psycopg

    kwargs.setdefault("connect_timeout", connect_timeout())
    conninfo = libpq_conninfo(dsn)
    try:
        conn = psycopg.connect(conninfo, **kwargs)
    except psycopg.Error as exc:
        if start_again_if_stopped(dsn):  # this process's embedded server, stopped meanwhile
            return connect(dsn, **kwargs)
        reason = _scrub(
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, dsn
        )
        host = dsn_params(dsn).get("host", "")
        if host.startswith("/"):  # a Unix socket folder, as the embedded server's
            hint = (
                f"nothing listens on the socket in {host}; if that is tokrag's embedded server "
                f"it was stopped: leave --dsn and {DSN_ENV} unset and tokrag starts it again "
                "(or start it with `pg_ctl -D DATA_FOLDER start`)"
            )
        else:
            hint = (
                f"check the host, port, user and password in --dsn / {DSN_ENV}, or leave both "
                "unset to use the embedded server"
            )
        raise PostgresConnectionError(
            f"Cannot connect to Postgres at {mask_dsn(dsn)}: {reason}. {hint[0].upper()}{hint[1:]}."
        ) from None
    try:
        # Checked first, so a user without CREATE privilege can use an installed extension,
        # and created under an advisory lock, so concurrent first connections do not race.
        if not conn.execute("SELECT 1 FROM pg_extension WHERE extname = 'vector'").fetchone():
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('tokrag:vector', 0))")
                conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
        conn.commit()
        from pgvector.psycopg import register_vector

        register_vector(conn)
    except psycopg.Error as exc:
        conn.close()
        reason = _scrub(str(exc).strip().splitlines()[0], dsn)
        raise PostgresConnectionError(
            f"Postgres at {mask_dsn(dsn)} cannot use pgvector: {reason}. Install the pgvector "
            "extension on that server (https://github.com/pgvector/pgvector) or ask its "
            "administrator to run CREATE EXTENSION vector."
        ) from None
    return conn


def check_connection(dsn: str) -> str:
    """Connect once and return the server's version string (fails fast, see :func:`connect`)."""
    with connect(dsn) as conn:
        row = conn.execute("SELECT current_setting('server_version')").fetchone()
    return str(row[0]) if row else "?"
