"""One ``psycopg_pool.ConnectionPool`` per database, shared by retrieval, ``count``, the
layout checks and ingestion in this process.

:func:`pooled` lends a connection (autocommit, pgvector registered) and turns pool and
driver failures into the one-sentence errors of :mod:`.server`. The pool size and the wait
for a free connection come from the first caller's arguments, else from
``$TOKRAG_PG_POOL_SIZE`` (default 10) and ``$TOKRAG_PG_POOL_TIMEOUT`` (seconds, default 30).
A connection found broken when lent is replaced; when the embedded server of this process
was stopped from outside, it is started again first (as :func:`.server.connect` does).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .. import config
from .server import (
    PostgresConnectionError,
    PostgresSetupError,
    connect,
    connect_timeout,
    libpq_conninfo,
    mask_dsn,
    start_again_if_stopped,
)

__all__ = ["DEFAULT_POOL_SIZE", "DEFAULT_POOL_TIMEOUT", "close_pools", "pool_settings", "pooled", "shared_pool"]

#: Most connections one pool opens (``$TOKRAG_PG_POOL_SIZE``).
DEFAULT_POOL_SIZE = config.DEFAULT_PG_POOL_SIZE
#: Seconds a caller waits for a free connection (``$TOKRAG_PG_POOL_TIMEOUT``).
DEFAULT_POOL_TIMEOUT = config.DEFAULT_PG_POOL_TIMEOUT_S

_POOLS: dict[str, Any] = {}
_POOLS_LOCK = threading.Lock()


def _number(name: str, value: Any, read: Any, kind: type) -> Any:
    if value is None:
        try:
            return read()
        except config.ConfigError as exc:
            raise PostgresSetupError(str(exc)) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}.")
    if kind is int and int(value) != value:
        raise ValueError(f"{name} must be a whole number, got {value!r}.")
    return kind(value)


def pool_settings(size: int | None = None, timeout: float | None = None) -> tuple[int, float]:
    """``(size, timeout)`` from the arguments, else the environment, else the defaults.

    Raises:
        ValueError: A size or timeout that is not a positive number.
        PostgresSetupError: The environment variable is not a number.
    """
    return (
        _number("pool_size", size, config.pg_pool_size, int),
        _number("pool_timeout", timeout, config.pg_pool_timeout, float),
    )


def _connection_class(dsn: str) -> type:
    import psycopg

    class _RestartingConnection(psycopg.Connection):  # type: ignore[type-arg]
        """Starts this process's embedded server again when it was stopped from outside."""

        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            try:
                return super().connect(*args, **kwargs)
            except psycopg.OperationalError:
                if start_again_if_stopped(dsn):
                    return super().connect(*args, **kwargs)
                raise

    return _RestartingConnection


def _configure(conn: Any) -> None:
    from pgvector.psycopg import register_vector

    register_vector(conn)


def shared_pool(dsn: str, size: int | None = None, timeout: float | None = None) -> Any:
    """The process's pool for ``dsn`` (opened on first use; later sizes are ignored).

    The first connection is made with :func:`.server.connect`, which fails fast with a
    masked message and creates the ``vector`` extension if needed.
    """
    size, timeout = pool_settings(size, timeout)
    with _POOLS_LOCK:
        pool = _POOLS.get(dsn)
        if pool is not None and not pool.closed:
            return pool
        from psycopg_pool import ConnectionPool

        connect(dsn, autocommit=True).close()  # reachable, pgvector present (one sentence if not)
        pool = ConnectionPool(
            libpq_conninfo(dsn),
            connection_class=_connection_class(dsn),
            # prepare_threshold=None: no server-side prepared statements, so every search
            # is planned with its own parameters and settings (a cached generic plan would
            # keep a sequential scan chosen under other settings, or an unknown LIMIT)
            kwargs={
                "autocommit": True,
                "connect_timeout": connect_timeout(),
                "prepare_threshold": None,
            },
            min_size=0,  # none kept open when idle: nothing reconnects to a stopped server
            max_size=size,
            timeout=timeout,
            configure=_configure,
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
        cm = pool.connection()
        conn = cm.__enter__()
    except PoolTimeout:
        raise PostgresConnectionError(
            f"No connection to Postgres at {mask_dsn(dsn)} within {pool.timeout:g} s (pool of "
            f"{pool.max_size}): the server is unreachable or every connection is busy; raise "
            "pool_size / $TOKRAG_PG_POOL_SIZE or pool_timeout / $TOKRAG_PG_POOL_TIMEOUT, or "
            "check the server."
        ) from None
    try:
        yield conn
    except BaseException as exc:
        if not cm.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        cm.__exit__(None, None, None)


def close_pools() -> None:
    """Close every pool of this process (they are also closed at interpreter exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
