"""Where the Postgres comes from (:func:`resolve_dsn`) and the connections to it:
:func:`connect` (checked, pgvector created if needed) and :func:`pooled` (the process's one
``psycopg_pool.ConnectionPool`` per database)."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from .. import config
from .dsn import (
    PostgresConnectionError,
    PostgresSetupError,
    dsn_params,
    first_line,
    libpq_conninfo,
    mask_dsn,
)
from .embedded import DSN_ENV, start_again_if_stopped, start_embedded

_POOLS: dict[str, Any] = {}
_POOLS_LOCK = threading.Lock()


def _setting(read: Any) -> Any:
    """An environment setting from :mod:`..config`; a bad value is a setup error."""
    try:
        return read()
    except config.ConfigError as exc:
        raise PostgresSetupError(str(exc)) from None


def connect_timeout() -> int:
    """Seconds to wait for a connection: ``$TOKRAG_PG_CONNECT_TIMEOUT`` (default 5), read
    when a connection is made."""
    return _setting(config.pg_connect_timeout)


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
    """``dsn``, else ``$TOKRAG_PG_DSN``, else the embedded server (started on first use).

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
    """A psycopg 3 connection with pgvector registered (the extension created if missing).

    Raises:
        PostgresConnectionError: The server is unreachable, refuses the login, or lacks the
            ``vector`` extension (the message is scrubbed of the password).
    """
    import psycopg

    kwargs.setdefault("connect_timeout", connect_timeout())
    try:
        conn = psycopg.connect(libpq_conninfo(dsn), **kwargs)
    except psycopg.Error as exc:
        if start_again_if_stopped(dsn):  # this process's embedded server, stopped meanwhile
            return connect(dsn, **kwargs)
        host = dsn_params(dsn).get("host", "")
        if host.startswith("/"):  # a Unix socket folder, as the embedded server's
            hint = (
                f"Nothing listens on the socket in {host}; if that is tokrag's embedded server "
                f"it was stopped: leave --dsn and {DSN_ENV} unset and tokrag starts it again "
                "(or start it with `pg_ctl -D DATA_FOLDER start`)"
            )
        else:
            hint = (
                f"Check the host, port, user and password in --dsn / {DSN_ENV}, or leave both "
                "unset to use the embedded server"
            )
        raise PostgresConnectionError(
            f"Cannot connect to Postgres at {mask_dsn(dsn)}: {first_line(exc, dsn)}. {hint}."
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
        raise PostgresConnectionError(
            f"Postgres at {mask_dsn(dsn)} cannot use pgvector: {first_line(exc, dsn)}. Install "
            "the pgvector extension on that server (https://github.com/pgvector/pgvector) or "
            "ask its administrator to run CREATE EXTENSION vector."
        ) from None
    return conn


def check_connection(dsn: str) -> str:
    """Connect once and return the server's version string (fails fast, see :func:`connect`)."""
    with connect(dsn) as conn:
        row = conn.execute("SELECT current_setting('server_version')").fetchone()
    return str(row[0]) if row else "?"


# ============================================================================ the pool
def pool_settings(size: int | None = None, timeout: float | None = None) -> tuple[int, float]:
    """``(size, timeout)`` from the arguments, else ``$TOKRAG_PG_POOL_SIZE`` (10) and
    ``$TOKRAG_PG_POOL_TIMEOUT`` (30 s).

    Raises:
        ValueError: A size or timeout that is not a positive number.
        PostgresSetupError: The environment variable is not a number.
    """
    out = []
    for name, value, read, kind in (
        ("pool_size", size, config.pg_pool_size, int),
        ("pool_timeout", timeout, config.pg_pool_timeout, float),
    ):
        if value is None:
            out.append(_setting(read))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}.")
        if kind is int and int(value) != value:
            raise ValueError(f"{name} must be a whole number, got {value!r}.")
        out.append(kind(value))
    return out[0], out[1]


@cache
def _connection_class() -> type:
    import psycopg

    class RestartingConnection(psycopg.Connection):  # type: ignore[type-arg]
        """Starts this process's embedded server again when it was stopped from outside."""

        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:  # type: ignore[override]
            try:
                return super().connect(conninfo, **kwargs)
            except psycopg.OperationalError:
                if start_again_if_stopped(conninfo):
                    return super().connect(conninfo, **kwargs)
                raise

    return RestartingConnection


def shared_pool(dsn: str, size: int | None = None, timeout: float | None = None) -> Any:
    """The process's pool for ``dsn``, opened on first use (later sizes are ignored) after
    one :func:`connect` (fails fast, creates the ``vector`` extension if needed)."""
    size, timeout = pool_settings(size, timeout)
    with _POOLS_LOCK:
        pool = _POOLS.get(dsn)
        if pool is not None and not pool.closed:
            return pool
        from pgvector.psycopg import register_vector
        from psycopg_pool import ConnectionPool

        connect(dsn, autocommit=True).close()
        pool = ConnectionPool(
            libpq_conninfo(dsn),
            connection_class=_connection_class(),
            # no server-side prepared statements: every search is planned with its own
            # parameters and settings
            kwargs={
                "autocommit": True,
                "connect_timeout": connect_timeout(),
                "prepare_threshold": None,
            },
            min_size=0,  # none kept open when idle: nothing reconnects to a stopped server
            max_size=size,
            timeout=timeout,
            configure=register_vector,
            check=ConnectionPool.check_connection,
            name=f"tokrag:{mask_dsn(dsn)}",
            open=True,
        )
        _POOLS[dsn] = pool
        return pool


@contextmanager
def pooled(dsn: str) -> Iterator[Any]:
    """A connection of :func:`shared_pool` for the block (autocommit; returned afterwards).

    Raises:
        PostgresConnectionError: No connection could be had within the pool timeout.
    """
    from psycopg_pool import PoolTimeout

    pool = shared_pool(dsn)
    try:
        with pool.connection() as conn:
            yield conn
    except PoolTimeout:
        raise PostgresConnectionError(
            f"No connection to Postgres at {mask_dsn(dsn)} within {pool.timeout:g} s (pool of "
            f"{pool.max_size}): the server is unreachable or every connection is busy; raise "
            "pool_size / $TOKRAG_PG_POOL_SIZE or pool_timeout / $TOKRAG_PG_POOL_TIMEOUT, or "
            "check the server."
        ) from None


def close_pools() -> None:
    """Close every pool of this process (they are also closed at interpreter exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
