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

Embedded data folder (:func:`default_data_dir`): ``$TOKRAG_DATA_DIR/pg`` when that is set,
else ``$XDG_DATA_HOME/tokrag/pg`` (``~/.local/share/tokrag/pg``). **Running as root** is
different: pgserver then runs Postgres as a separate system user (``pgserver``) and makes
every parent folder of the data folder group/other-readable and traversable (``chmod
g+rx,o+rx`` up to ``/``). Under ``/root`` that would open the root user's home, so as root
the default is ``/var/lib/tokrag/pg`` (whose parents are world-traversable already), and a
data folder inside the root user's home is refused with an error naming the fix.

**No other local user can reach the embedded server** (it trusts every connection that
reaches its socket). The server listens on a Unix socket only, in a folder that only the
server's own OS user may enter (mode 0700): the data folder itself, or, when the data
folder's path is too long for a Unix socket (about 107 bytes), a private
``$TMPDIR/tokrag-pg-<uid>/<hash>`` folder (never pgserver's world-writable fallback). The
socket file itself is made owner-only (``unix_socket_permissions=0700``). tokrag starts the
server itself (:class:`_server_class`) for this; pgserver still creates the data folder, the
system user as root, and stops the server when the last process using it exits. A server
found running with its socket in a folder other users can enter (started by an older
version) is refused with the way to restart it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shlex
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
#: Environment variable holding a production connection string.
DSN_ENV = "TOKRAG_PG_DSN"
#: Environment variable overriding the per-user data folder.
DATA_DIR_ENV = "TOKRAG_DATA_DIR"
#: Environment variable: seconds to wait for a connection (fail fast on a wrong host).
CONNECT_TIMEOUT_ENV = "TOKRAG_PG_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 5

# LlamaIndex creates ``data_<name>`` and indexes ``data_<name>_embedding_idx``; Postgres
# silently truncates identifiers past 63 bytes, so the name is kept well under that.
_TABLE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,39}$")
#: PostgreSQL 16 keywords that cannot name a table unquoted, beyond SQLAlchemy's list of its
#: reserved words (``pg_get_keywords()`` categories R and T; a test compares with the server).
_MORE_RESERVED = frozenset({"collation", "concurrently", "lateral", "system_user", "tablesample"})


class PostgresConnectionError(ConnectionError):
    """The database cannot be reached or used; the message never contains a password."""


class PostgresQueryError(PostgresConnectionError):
    """Postgres refused an operation (a missing privilege, a table that is not tokrag's...).

    A :class:`PostgresConnectionError` ("the database cannot be used"), so the CLI reports
    it in one sentence with exit status 3; the message never contains a password.
    """


class PostgresSetupError(RuntimeError):
    """The embedded server cannot be started (or would be started in an unsafe place)."""


# SQLSTATE class or code -> what to do about it (https://www.postgresql.org/docs/16/errcodes-appendix.html).
_SQLSTATE_HINTS = {
    "42501": "grant the database user the privilege it lacks (e.g. GRANT CREATE ON SCHEMA public, "
    "or SELECT, INSERT and DELETE on the table), or connect as a user that has it",
    "42P01": "run `tokrag ingest` into that table first",
    "08": "check that the server is running and reachable, then re-run",
    "53": "the server is out of disk, memory or connections; free some and re-run",
    "57": "the server cancelled the operation or is shutting down; re-run when it is back",
    "40": "the transaction was rolled back because of a concurrent one; re-run",
}


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE code of a psycopg / psycopg2 error, or of the one a SQLAlchemy error wraps."""
    for err in (exc, getattr(exc, "orig", None)):
        code = getattr(err, "sqlstate", None) or getattr(err, "pgcode", None)
        if code:
            return str(code)
    return None


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the database stack (psycopg, psycopg2, SQLAlchemy, asyncpg)."""
    root = type(exc).__module__.split(".", 1)[0]
    return root in {"psycopg", "psycopg2", "sqlalchemy", "asyncpg"}


def query_error(exc: BaseException, dsn: str, action: str) -> PostgresQueryError:
    """One sentence for a driver error while doing ``action`` (password scrubbed)."""
    base = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(base).strip().splitlines() if line.strip()]
    reason = _scrub(lines[0] if lines else type(base).__name__, dsn).rstrip(".")
    code = sqlstate_of(exc) or ""
    hint = _SQLSTATE_HINTS.get(code) or _SQLSTATE_HINTS.get(code[:2])
    hint = hint or f"see the server log for details (SQLSTATE {code or 'unknown'})"
    return PostgresQueryError(
        f"Postgres at {mask_dsn(dsn)} refused to {action}: {reason}; {hint}."
    )


@contextmanager
def database_errors(dsn: str, action: str) -> Iterator[None]:
    """Turn driver errors raised inside the block into one-sentence :class:`PostgresQueryError` errors."""
    try:
        yield
    except (PostgresConnectionError, PostgresSetupError):
        raise
    except Exception as exc:
        if not is_driver_error(exc):
            raise
        raise query_error(exc, dsn, action) from None


# ============================================================================ DSN helpers
#: Connection parameters whose values are secrets (never shown).
_SECRET_KEYS = frozenset({"password", "sslpassword"})
_URL_SCHEMES = ("postgresql", "postgres")


def connect_timeout() -> int:
    """Seconds to wait for a connection: ``$TOKRAG_PG_CONNECT_TIMEOUT`` (default 5).

    Read when a connection is made, so a bad value fails the database commands with a
    sentence instead of breaking every command at import.

    Raises:
        PostgresSetupError: The value is not a positive number of seconds.
    """
    raw = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise PostgresSetupError(
            f"{CONNECT_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to a positive "
            f"number such as 5 (or unset it for the default of {DEFAULT_CONNECT_TIMEOUT_S})."
        )
    return max(1, math.ceil(value))


def _url_parts(dsn: str) -> tuple[str, str | None] | None:
    """``(scheme, rest)`` when ``dsn`` is a URL (``scheme://rest``), else ``None``."""
    scheme, sep, rest = dsn.partition("://")
    if not sep or not scheme or not all(c.isascii() and (c.isalnum() or c in "+-.") for c in scheme):
        return None
    return scheme, rest


def _parse(dsn: str) -> tuple[dict[str, str], bool, bool]:
    """libpq's reading of ``dsn``: ``(parameters, is_url, has_password_field)``.

    Key=value strings go to libpq's parser (``psycopg.conninfo.conninfo_to_dict``) as they
    are. In a URL the user name and password are everything between ``://`` and the *last*
    ``@`` (host names never contain one), split at the first ``:``; they are percent-decoded
    and re-encoded, so a password may hold ``/ ? # @ : %XX`` or spaces written as they are,
    and libpq parses the result. Nothing here ever echoes the string in an error.

    Raises:
        PostgresConnectionError: Not a Postgres URL, or libpq cannot parse it.
    """
    from urllib.parse import quote, unquote

    from psycopg.conninfo import conninfo_to_dict

    if not isinstance(dsn, str) or not dsn.strip():
        raise PostgresConnectionError(
            "The connection string is empty; use postgresql://USER:PASSWORD@HOST:PORT/DATABASE."
        )
    url = _url_parts(dsn)
    has_password = False
    if url is None:
        text = dsn
    else:
        scheme, rest = url
        backend = scheme.lower().split("+", 1)[0]
        if backend not in _URL_SCHEMES:
            raise PostgresConnectionError(
                f"Not a Postgres connection URL (scheme {scheme!r}); use the form "
                "postgresql://USER:PASSWORD@HOST:PORT/DATABASE."
            )
        at = rest.rfind("@")
        if at >= 0:
            user, colon, password = rest[:at].partition(":")
            has_password = bool(colon)
            userinfo = quote(unquote(user), safe="")
            if colon:
                userinfo += ":" + quote(unquote(password), safe="")
            rest = f"{userinfo}@{rest[at + 1:]}"
        text = f"postgresql://{rest}"
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(text).items()}
    except Exception:  # noqa: BLE001 - the parser's message can quote the string
        raise PostgresConnectionError(
            "The connection string cannot be parsed (not shown: it may hold a password); use "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (percent-encode '%' as %25) or "
            "libpq's key=value form."
        ) from None
    return params, url is not None, has_password or any(k in params for k in _SECRET_KEYS)


def dsn_params(dsn: str) -> dict[str, str]:
    """The libpq connection parameters of ``dsn`` (URL or key=value; see :func:`_parse`)."""
    return _parse(dsn)[0]


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***``, rebuilt from libpq's parse of it.

    URLs come back as URLs and key=value strings as key=value strings; a string that cannot
    be parsed is not shown at all.

    >>> mask_dsn("postgresql://alice:s3cret@db.example:5432/rag")
    'postgresql://alice:***@db.example:5432/rag'
    >>> mask_dsn("host=db user=alice password='a b' dbname=rag")
    'host=db user=alice password=*** dbname=rag'
    """
    from urllib.parse import quote

    from psycopg.conninfo import make_conninfo

    try:
        params, is_url, has_password = _parse(dsn)
    except PostgresConnectionError:
        return "<connection string not shown: it cannot be parsed>"
    if not is_url:
        order = ["host", "port", "user", "password", "dbname"]
        keys = [k for k in order if k in params] + [k for k in params if k not in order]
        shown = {k: ("***" if k in _SECRET_KEYS else params[k]) for k in keys}
        return make_conninfo(**shown)
    rest = {k: v for k, v in params.items() if k not in _SECRET_KEYS}
    user = rest.pop("user", None)
    netloc = quote(user, safe="") if user is not None else ""
    if has_password:
        netloc += ":***"
    if netloc:
        netloc += "@"
    host = rest.get("host")
    if host and not host.startswith("/") and "," not in host:
        netloc += f"[{host}]" if ":" in host else host
        del rest["host"]
        port = rest.pop("port", None)
        if port is not None:
            netloc += f":{port}"
    path = "/" + quote(rest.pop("dbname"), safe="") if "dbname" in rest else ""
    query = "&".join(f"{quote(k, safe='')}={quote(v, safe='/')}" for k, v in rest.items())
    return f"postgresql://{netloc}{path}" + (f"?{query}" if query else "")


def _secrets_of(dsn: str) -> set[str]:
    try:
        params = dsn_params(dsn)
    except PostgresConnectionError:
        return set()
    return {params[k] for k in _SECRET_KEYS if params.get(k)}


def _scrub(message: str, dsn: str) -> str:
    """``message`` with the DSN and its passwords (plain and URL-quoted) blanked out."""
    from urllib.parse import quote, quote_plus

    out = message.replace(dsn, mask_dsn(dsn)) if dsn else message
    for secret in _secrets_of(dsn):
        for form in (secret, quote(secret, safe=""), quote_plus(secret)):
            out = out.replace(form, "***")
    return out


def sqlalchemy_url(dsn: str, driver: str = "psycopg", *, hide_password: bool = False) -> str:
    """``dsn`` (URL or key=value) as a SQLAlchemy URL with the given driver.

    Built from libpq's parse of ``dsn`` (:func:`dsn_params`), so SQLAlchemy and libpq read
    the same user, password and host. ``hide_password=True`` renders the password as ``***``.
    """
    from sqlalchemy.engine import URL

    params = dsn_params(dsn)
    user = params.pop("user", None)
    password = params.pop("password", None)
    host = params.pop("host", None)
    port = params.pop("port", None)
    dbname = params.pop("dbname", None)
    query: dict[str, str] = {}
    url_host, url_port = None, None
    if host and not host.startswith("/") and "," not in host:
        url_host = host
        if port is not None and port.isdigit():
            url_port = int(port)
        elif port is not None:
            query["port"] = port
    else:
        if host:
            query["host"] = host
        if port is not None:
            query["port"] = port
    query.update(params)
    url = URL.create(
        f"postgresql+{driver}" if driver else "postgresql",
        username=user,
        password=password,
        host=url_host,
        port=url_port,
        database=dbname,
        query=query,
    )
    return url.render_as_string(hide_password=hide_password)


def libpq_conninfo(dsn: str) -> str:
    """``dsn`` as a libpq ``key=value`` string (what psycopg connects with)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(**dsn_params(dsn))


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
#: pgserver guards its servers with one file lock per process (a class attribute), which is not
#: safe between threads: a pool thread starting a stopped server again and another thread
#: stopping or creating one would release each other's lock. Every use of it here goes
#: through this lock first.
_PGSERVER_LOCK = threading.RLock()
#: pgserver's list of the processes using a server, in the data folder.
HANDLE_FILE = ".handle_pids.json"


def _process_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # NoSuchProcess, AccessDenied on a reused pid we cannot see
        return psutil.pid_exists(pid)


def prune_stale_handles(data_dir: str | Path) -> list[int]:
    """Drop processes that no longer exist from pgserver's handle list; returns their PIDs.

    pgserver stops the server when the *last* process in ``<data_dir>/.handle_pids.json``
    exits normally. A process killed with SIGKILL (or by the OOM killer) never removes its
    PID, so without this the server would run forever: every later process would see a
    "still used" entry and leave it running. Called (under pgserver's own inter-process
    lock) before attaching, so the next process that uses the folder owns the server and
    stops it when it exits.
    """
    import json

    handle_file = Path(data_dir).expanduser().resolve() / HANDLE_FILE
    if not handle_file.exists():
        return []
    PostgresServer = _import_pgserver().postgres_server.PostgresServer

    with PostgresServer._lock:
        try:
            pids = json.loads(handle_file.read_text())
        except (OSError, ValueError):
            return []
        if not isinstance(pids, list):
            return []
        alive = [p for p in pids if isinstance(p, int) and _process_alive(p)]
        dead = [p for p in pids if p not in alive]
        if dead:
            handle_file.write_text(json.dumps(alive))
    return dead


def _import_pgserver() -> Any:
    """``pgserver``, imported without platformdirs' "XDG_RUNTIME_DIR is not set" warning.

    pgserver keeps only its lock file in the user's runtime folder; when the variable is
    unset (containers, ``su``, cron) platformdirs falls back to ``/run/user/<uid>`` or a
    private folder in the temporary directory, which serves as well, so the warning (with a
    source line, on every command) tells the user nothing they need to act on.

    Raises:
        ImportError: ``pgserver`` is not installed.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR", category=UserWarning)
        import pgserver
        import pgserver.postgres_server  # noqa: F401 - computes the runtime folder on import
    return pgserver


#: Longest Unix socket path: ``sun_path`` holds 108 bytes on Linux, 104 on macOS (with the NUL).
_SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
#: The socket file Postgres creates in its socket folder (the port is always the default).
_SOCKET_NAME = ".s.PGSQL.5432"
#: Characters pg_ctl cannot pass through the ``"..."`` quoting of the shell command it runs
#: (``-D "<data folder>"``): the server would start elsewhere, or not at all.
_UNQUOTABLE = '"$`\\\n'


def _check_quotable(folder: Path) -> None:
    """Refuse a data folder path that pg_ctl's shell command cannot carry (spaces are fine)."""
    bad = sorted({c for c in str(folder.absolute()) if c in _UNQUOTABLE})
    if bad:
        shown = " ".join(repr(c) for c in bad)
        raise PostgresSetupError(
            f"The embedded Postgres cannot use the data folder {str(folder)!r}: pg_ctl passes "
            f"it through a shell, which cannot carry {shown} in it; set {DATA_DIR_ENV} to a "
            "path without them."
        )


def _server_user_ids(system_user: str | None) -> tuple[int, int]:
    """``(uid, gid)`` the server runs as: pgserver's system user as root, else this process's."""
    if system_user is None:
        return os.geteuid(), os.getegid()
    import pwd

    entry = pwd.getpwnam(system_user)
    return entry.pw_uid, entry.pw_gid


def _socket_fits(folder: Path) -> bool:
    return len(os.fsencode(str(folder / _SOCKET_NAME))) <= _SOCKET_PATH_MAX


def _private_folder(folder: Path, uid: int, gid: int) -> Path:
    """``folder``, created 0700 for ``uid`` (or already exactly that: not a link, its owner, 0700).

    Raises:
        PostgresSetupError: ``folder`` exists as something else (e.g. made by another user
            in the shared temporary folder).
    """
    try:
        folder.mkdir(mode=0o700)
        if os.geteuid() != uid:  # root making the folder for pgserver's system user
            os.chown(folder, uid, gid)
    except FileExistsError:
        pass
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise PostgresSetupError(
            f"Refusing to put the embedded Postgres socket in {folder}: it is not a private "
            f"folder of user id {uid} (owner {st.st_uid}, mode {stat.filemode(st.st_mode)}), so "
            "another local user could reach or replace the server. Remove it (or set "
            f"{DATA_DIR_ENV} to a shorter path) and re-run."
        )
    return folder


def _socket_folder(pgdata: Path, uid: int, gid: int) -> Path:
    """Where the server's socket goes: the data folder (0700, the server user's own), or, when
    its path is too long for a Unix socket, ``$TMPDIR/tokrag-pg-<uid>/<hash of the path>``
    (both levels private to the server's user; ``/tmp`` when ``$TMPDIR`` is long too).

    Raises:
        PostgresSetupError: No candidate is short enough, or one is not private.
    """
    if _socket_fits(pgdata):
        return pgdata
    digest = hashlib.sha256(os.fsencode(str(pgdata))).hexdigest()[:12]
    for base in dict.fromkeys([Path(tempfile.gettempdir()), Path("/tmp")]):
        folder = base / f"tokrag-pg-{uid}" / digest
        if _socket_fits(folder):
            _private_folder(folder.parent, uid, gid)
            return _private_folder(folder, uid, gid)
    raise PostgresSetupError(
        f"The embedded Postgres in {pgdata} needs a Unix socket path under "
        f"{_SOCKET_PATH_MAX} bytes and neither the data folder nor $TMPDIR gives one; set "
        f"{DATA_DIR_ENV} (or TMPDIR) to a shorter path."
    )


def _is_private(folder: Path, uid: int) -> bool:
    try:
        st = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077


def _log_reason(log: Path) -> str:
    """The last FATAL/ERROR line of the server log (what went wrong), or a pointer to the log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        if "FATAL:" in line or "ERROR:" in line or "PANIC:" in line:
            return line.split(":  ", 1)[-1].strip()
    return "pg_ctl could not start it"


_SERVER_CLASS: Any = None


def _server_class() -> Any:
    """pgserver's ``PostgresServer``, started so that no other local user can reach it.

    pgserver's own start puts the socket in a world-writable folder when the data folder's
    path is too long, passes the folder to the server unquoted (a space breaks it) and logs
    the whole server log on failure. Only that step is replaced (``ensure_postgres_running``);
    initdb, pgserver's system user as root, the handle list and the stop at exit are
    pgserver's.
    """
    global _SERVER_CLASS
    if _SERVER_CLASS is not None:
        return _SERVER_CLASS
    from pgserver._commands import POSTGRES_BIN_PATH
    from pgserver.postgres_server import PostgresServer
    from pgserver.utils import PostmasterInfo

    class PrivateSocketServer(PostgresServer):
        """A ``PostgresServer`` whose Unix socket only its own OS user (and root) can reach."""

        def _cleanup(self) -> None:
            with _PGSERVER_LOCK:
                self._cleaned_up = True  # stopped on purpose: not to be started again
                super()._cleanup()

        def ensure_postgres_running(self) -> None:  # called under pgserver's lock
            uid, gid = _server_user_ids(self.system_user)
            info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is None or not info.is_running():
                self._start(uid, gid)
                info = PostmasterInfo.read_from_pgdata(self.pgdata)
            if info is None or not info.is_running() or info.status != "ready":
                raise PostgresSetupError(
                    f"The embedded Postgres in {self.pgdata} did not become ready: "
                    f"{_log_reason(self.log)}. See {self.log}."
                )
            if info.socket_dir is None or not _is_private(info.socket_dir, uid):
                raise PostgresSetupError(
                    f"The embedded Postgres in {self.pgdata} is already running with its socket "
                    f"in {info.socket_dir}, which other local users can reach (started by an "
                    f"older version?). Stop it with `pg_ctl -D '{self.pgdata}' stop` (as "
                    f"{self.system_user or 'this user'}) and re-run: it restarts with a "
                    "private socket."
                )
            self._postmaster_info = info

        def get_uri(self, database: str | None = None) -> str:
            """The connection URL, with the socket folder percent-encoded (it may hold spaces)."""
            from urllib.parse import quote

            folder = quote(str(self.get_postmaster_info().socket_dir), safe="/")
            return f"postgresql://postgres:@/{quote(database or 'postgres', safe='')}?host={folder}"

        def _start(self, uid: int, gid: int) -> None:
            socket_folder = _socket_folder(self.pgdata, uid, gid)
            # pg_ctl runs the server through /bin/sh: -o is shell text, so the folder is quoted.
            options = (
                f"-h '' -k {shlex.quote(str(socket_folder))} -c unix_socket_permissions=0700"
            )
            command = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.pgdata), "-w",
                       "-t", "60", "-o", options, "-l", str(self.log), "start"]  # fmt: skip
            as_user: dict[str, Any] = {}
            if self.system_user is not None:  # root: the server's own user and group only
                as_user = {"user": uid, "group": gid, "extra_groups": []}
            done = subprocess.run(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, timeout=90, check=False, **as_user,
            )  # fmt: skip
            if done.returncode != 0:
                raise PostgresSetupError(
                    f"Could not start the embedded Postgres in {self.pgdata}: "
                    f"{_log_reason(self.log)}. See {self.log} for the server log, or pass "
                    f"--dsn / set {DSN_ENV}."
                )

    _SERVER_CLASS = PrivateSocketServer
    return _SERVER_CLASS


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _stop_on_sigterm() -> None:
    """Make SIGTERM end the process as Ctrl-C does, so the embedded server is stopped at exit.

    SIGTERM's default action (``timeout``, systemd, ``docker stop``) kills Python without
    running ``atexit``, where pgserver stops the server, so it would keep running. Installed
    only while SIGTERM still has its default action, from the main thread: a handler the
    application set is left alone.
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def start_embedded(data_dir: str | Path | None = None) -> tuple[str, Any]:
    """Start (or attach to) the embedded server; returns ``(dsn, server_handle)``.

    The server is started once per data folder and process, and stopped by ``pgserver``
    when the last process using it exits (its data stays for the next run). A process that
    was killed (SIGKILL) cannot stop it: the server then keeps running until the next
    process using the folder exits, which first removes the dead process from pgserver's
    handle list (:func:`prune_stale_handles`). SIGTERM ends the process as Ctrl-C does (exit
    status 143), so the server is stopped then too (:func:`_stop_on_sigterm`). Its socket is
    private to the server's OS user (see the module docstring).

    Raises:
        PostgresSetupError: ``pgserver`` is missing, the folder is unsafe (root), or the
            server fails to start (the message names the server log).
    """
    folder = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    _check_root_safe(folder)
    _check_quotable(folder)
    try:
        _import_pgserver()
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
                pgdata = folder.resolve()
                pgdata.mkdir(mode=0o700, exist_ok=True)
                prune_stale_handles(pgdata)
                server_class = _server_class()
                server = server_class._instances.get(pgdata)
                if server is None:
                    try:
                        with _PGSERVER_LOCK:
                            server = server_class(pgdata, cleanup_mode="stop")
                    finally:  # pgserver registers the instance before starting it
                        if server is None:
                            server_class._instances.pop(pgdata, None)
            except PostgresSetupError:
                raise
            except Exception as exc:  # noqa: BLE001 - re-raised with the fix in the message
                raise PostgresSetupError(
                    f"Could not start the embedded Postgres in {folder}: {exc}. See "
                    f"{folder / 'log'} for the server log, or pass --dsn / set {DSN_ENV}."
                ) from exc
            _SERVERS[key] = server
    _start_again_if_stopped(server)
    _stop_on_sigterm()
    return server.get_uri(), server



def _start_again_if_stopped(server: Any) -> bool:
    """Start ``server`` again when it was stopped from outside this process (``pg_ctl stop``,
    another tool); returns whether it was. Same data folder and socket, so the connection
    string does not change; a warning says what happened.

    Raises:
        PostgresSetupError: It cannot be started again (the message names the server log).
    """
    from pgserver.utils import PostmasterInfo

    with _PGSERVER_LOCK, server._lock:
        if getattr(server, "_cleaned_up", False):
            return False
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        if info is not None and info.is_running():
            return False
        server.ensure_postgres_running()
        # Warned before the lock is released: a thread that finds it running afterwards (a
        # pool's other worker) hands out a connection only after the warning.
        warnings.warn(
            f"The embedded Postgres in {server.pgdata} had been stopped from outside this "
            "process; tokrag started it again.",
            RuntimeWarning,
            stacklevel=3,
        )
    return True


def start_again_if_stopped(dsn: str) -> bool:
    """Whether ``dsn`` is an embedded server of this process that was stopped from outside
    and has been started again (see :func:`_start_again_if_stopped`); ``False`` for any other
    database."""
    try:
        host = dsn_params(dsn).get("host")
    except PostgresConnectionError:
        return False
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
    for server in servers:
        info = server._postmaster_info
        if host and info is not None and str(info.socket_dir) == host:
            return _start_again_if_stopped(server)
    return False


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
