"""The errors of the Postgres layer; none of their messages ever holds a password."""

from __future__ import annotations

__all__ = [
    "PostgresConnectionError",
    "PostgresQueryError",
    "PostgresSetupError",
    "SearchInputError",
    "is_driver_error",
    "sqlstate_of",
]


class PostgresConnectionError(ConnectionError):
    """The database cannot be reached or used; the message never contains a password."""


class PostgresQueryError(PostgresConnectionError):
    """Postgres refused an operation (a missing privilege, a table that is not tokrag's...).

    A :class:`PostgresConnectionError` ("the database cannot be used"), so the CLI reports
    it in one sentence with exit status 3; the message never contains a password.
    """


class PostgresSetupError(RuntimeError):
    """The embedded server cannot be started (or would be started in an unsafe place)."""


class SearchInputError(ValueError):
    """A search input no query can carry (a NUL character, a lone surrogate, a number out of
    range), refused before any SQL runs; the message names the field, never the value's
    server, and :attr:`field` says which: ``"query"`` or ``"filters.<key>"``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
