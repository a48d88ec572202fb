"""Where the Postgres comes from: a connection string, or an embedded server from ``pgserver``.

Resolution order (:func:`resolve_dsn`):

1. an explicit ``dsn`` argument (the CLI's ``--dsn``);
2. the environment variable ``TOKRAG_PG_DSN``;
3. otherwise an embedded PostgreSQL 16 + pgvector from the ``pgserver`` package, started on
   first use in a per-user data folder and stopped when the process exits (the data stays,
   so the next run reuses it).

With 1 or 2 nothing is started. Connection strings are only ever shown through
:func:`mask_dsn` (``postgresql://alice:***@db:5432/rag``), and errors raised here are
scrubbed of the password.

Embedded data folder (:func:`default_data_dir`): ``$TOKRAG_DATA_DIR/pg`` when that is set,
else ``$XDG_DATA_HOME/tokrag/pg`` (``~/.local/share/tokrag/pg``). **Running as root** is
different: pgserver then runs Postgres as a separate system user (``pgserver``) and makes
every parent folder of the data folder group/other-readable and traversable (``chmod
g+rx,o+rx`` up to ``/``). Under ``/root`` that would open the root user's home, so as root
the default is ``/var/lib/tokrag/pg`` (whose parents are world-traversable already), and a
data folder inside the root user's home is refused with an error naming the fix.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_TABLE",
    "PostgresConnectionError",
    "PostgresSetupError",
    "ResolvedDatabase",
    "check_connection",
    "default_data_dir",
    "mask_dsn",
    "resolve_dsn",
    "sqlalchemy_url",
    "start_embedded",
    "validate_table_name",
]

#: Table name used when none is given (LlamaIndex stores it as ``data_<name>``).
DEFAULT_TABLE = "tokrag_docs"
#: Environment variable holding a production connection string.
DSN_ENV = "TOKRAG_PG_DSN"
#: Environment variable overriding the per-user data folder.
DATA_DIR_ENV = "TOKRAG_DATA_DIR"
#: Seconds to wait for a TCP connection before giving up (fail fast on a wrong host).
CONNECT_TIMEOUT_S = int(os.environ.get("TOKRAG_PG_CONNECT_TIMEOUT", "5"))

# LlamaIndex creates ``data_<name>`` and indexes ``data_<name>_embedding_idx``; Postgres
# silently truncates identifiers past 63 bytes, so the name is kept well under that.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")


class PostgresConnectionError(ConnectionError):
    """The database cannot be reached or used; the message never contains a password."""


class PostgresSetupError(RuntimeError):
    """The embedded server cannot be started (or would be started in an unsafe place)."""


# ============================================================================ DSN helpers
def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***`` (URL and ``key=value`` forms).

    >>> mask_dsn("postgresql://alice:s3cret@db.example:5432/rag")
    'postgresql://alice:***@db.example:5432/rag'
    """
    masked = re.sub(r"(://[^:/?#@]*:)[^@/?#]*@", r"\1***@", dsn)
    masked = re.sub(r"(?i)(password\s*=\s*)('[^']*'|[^\s&]*)", r"\1***", masked)
    return masked


def _password_of(dsn: str) -> str | None:
    try:
        from sqlalchemy.engine import make_url

        return make_url(dsn).password or None
    except Exception:  # noqa: BLE001 - a DSN we cannot parse has no password we can find
        match = re.search(r"://[^:/?#@]*:([^@/?#]*)@", dsn)
        return match.group(1) if match else None


def _scrub(message: str, dsn: str) -> str:
    """``message`` with the DSN's password (plain and URL-quoted) blanked out."""
    from urllib.parse import quote, unquote

    password = _password_of(dsn)
    out = message.replace(dsn, mask_dsn(dsn))
    if password:
        for form in {password, quote(password, safe=""), unquote(password)}:
            if form:
                out = out.replace(form, "***")
    return out


def sqlalchemy_url(dsn: str, driver: str = "psycopg") -> str:
    """``dsn`` rewritten for SQLAlchemy with the given driver (``postgresql+psycopg://``).

    Accepts ``postgresql://``, ``postgres://`` and ``postgresql+<driver>://`` URLs.
    """
    from sqlalchemy.engine import make_url

    try:
        url = make_url(dsn)
    except Exception:  # noqa: BLE001 - the parser's message would echo the DSN
        raise PostgresConnectionError(
            f"Not a Postgres connection URL: {mask_dsn(dsn)!r}. Use the form "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE."
        ) from None
    if url.get_backend_name() not in ("postgresql", "postgres"):
        raise PostgresConnectionError(
            f"Not a Postgres connection URL: {mask_dsn(dsn)!r} (scheme {url.drivername!r}). "
            "Use the form postgresql://USER:PASSWORD@HOST:PORT/DATABASE."
        )
    return url.set(drivername=f"postgresql+{driver}" if driver else "postgresql").render_as_string(
        hide_password=False
    )


def libpq_url(dsn: str) -> str:
    """``dsn`` as a plain ``postgresql://`` URL that psycopg/libpq accept."""
    return sqlalchemy_url(dsn, driver="")


def validate_table_name(table: str) -> str:
    """The table name, lower-cased, or a ``ValueError`` explaining the allowed form.

    Table names end up in DDL that cannot take bind parameters (LlamaIndex builds
    ``CREATE INDEX ... ON data_<name>`` with string formatting), so only plain ASCII
    identifiers are accepted: a letter or underscore, then letters, digits and underscores,
    at most 40 characters. Quotes, semicolons, spaces, dashes and non-ASCII letters are
    rejected rather than escaped.
    """
    if not isinstance(table, str) or not _TABLE_RE.fullmatch(table):
        raise ValueError(
            f"Invalid table name {table!r}: use 1-40 ASCII letters, digits and underscores, "
            "starting with a letter or underscore (e.g. 'tokrag_docs')."
        )
    return table.lower()


# ============================================================================ embedded server
def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_data_dir() -> Path:
    """Folder for the embedded server's data (see the module docstring for the root case)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser() / "pg"
    if _is_root():
        return Path("/var/lib/tokrag/pg")
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(base) / "tokrag" / "pg"


def _check_root_safe(data_dir: Path) -> None:
    """Refuse, as root, a data folder whose parents pgserver would open up inside a home."""
    if not _is_root():
        return
    resolved = data_dir.expanduser().resolve()
    homes = {Path("/root").resolve()}
    try:
        homes.add(Path.home().resolve())
    except RuntimeError:  # pragma: no cover - no home at all
        pass
    for home in homes:
        if resolved == home or home in resolved.parents:
            raise PostgresSetupError(
                f"Refusing to start the embedded Postgres in {resolved}: as root, pgserver makes "
                f"every parent folder world-readable, which would expose {home}. Set "
                f"{DATA_DIR_ENV} to a folder outside it (e.g. /var/lib/tokrag or a project "
                "folder), or pass --dsn / set TOKRAG_PG_DSN to use an existing server."
            )


_SERVERS: dict[Path, Any] = {}
_SERVERS_LOCK = threading.Lock()


def start_embedded(data_dir: str | Path | None = None) -> tuple[str, Any]:
    """Start (or attach to) the embedded server; returns ``(dsn, server_handle)``.

    The server is started once per data folder and process, and stopped by ``pgserver``
    when the last process using it exits (its data stays for the next run).

    Raises:
        PostgresSetupError: ``pgserver`` is missing, the folder is unsafe (root), or the
            server fails to start (the message names the server log).
    """
    folder = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    _check_root_safe(folder)
    try:
        import pgserver
    except ImportError:
        raise PostgresSetupError(
            "No connection string was given and the embedded server needs the 'pgserver' "
            "package: pip install 'tokrag-integrations[postgres]' (or pass --dsn / set "
            f"{DSN_ENV})."
        ) from None
    with _SERVERS_LOCK:
        key = folder.resolve() if folder.exists() else folder.absolute()
        server = _SERVERS.get(key)
        if server is None:
            try:
                folder.parent.mkdir(parents=True, exist_ok=True)
                server = pgserver.get_server(folder, cleanup_mode="stop")
            except Exception as exc:  # noqa: BLE001 - re-raised with the fix in the message
                raise PostgresSetupError(
                    f"Could not start the embedded Postgres in {folder}: {exc}. See "
                    f"{folder / 'log'} for the server log, or pass --dsn / set {DSN_ENV}."
                ) from exc
            _SERVERS[key] = server
    return server.get_uri(), server


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
    """Pick the database: ``dsn``, else ``$TOKRAG_PG_DSN``, else the embedded server."""
    if dsn:
        return ResolvedDatabase(dsn=dsn, origin="argument")
    env = os.environ.get(DSN_ENV)
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

    kwargs.setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    try:
        conn = psycopg.connect(libpq_url(dsn), **kwargs)
    except psycopg.Error as exc:
        reason = _scrub(
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__, dsn
        )
        raise PostgresConnectionError(
            f"Cannot connect to Postgres at {mask_dsn(dsn)}: {reason}. Check the host, port, "
            f"user and password in --dsn / {DSN_ENV}, or leave both unset to use the embedded "
            "server."
        ) from None
    try:
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
