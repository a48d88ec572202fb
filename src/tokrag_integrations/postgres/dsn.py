"""Connection strings (parsed by libpq, rendered by SQLAlchemy's ``URL``) and the errors of
the Postgres layer; no message ever holds a password."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class PostgresConnectionError(ConnectionError):
    """The database cannot be reached or used; the message never contains a password."""


class PostgresQueryError(PostgresConnectionError):
    """Postgres refused an operation (a missing privilege, a table that is not tokrag's...);
    reported by the CLI in one sentence with exit status 3."""


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
#: Connection parameters whose values are secrets (never shown).
_SECRET_KEYS = frozenset({"password", "sslpassword"})


def sqlstate_of(exc: BaseException) -> str | None:
    """The SQLSTATE code of a psycopg / psycopg2 error, or of the one a SQLAlchemy error wraps."""
    for err in (exc, getattr(exc, "orig", None)):
        code = getattr(err, "sqlstate", None) or getattr(err, "pgcode", None)
        if code:
            return str(code)
    return None


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the database stack (psycopg, psycopg2, SQLAlchemy, asyncpg)."""
    return type(exc).__module__.split(".", 1)[0] in {"psycopg", "psycopg2", "sqlalchemy", "asyncpg"}


def _parse(dsn: str) -> tuple[dict[str, str], bool, bool]:
    """libpq's reading of ``dsn``: ``(parameters, is_url, has_password_field)``.

    In a URL the credentials are everything between ``://`` and the *last* ``@``, split at the
    first ``:``, percent-decoded and re-encoded, so a password may hold ``/ ? # @ : %XX`` or
    spaces as they are. No error ever echoes the string.

    Raises:
        PostgresConnectionError: Not a Postgres URL, or libpq cannot parse it.
    """
    from urllib.parse import quote, unquote

    from psycopg.conninfo import conninfo_to_dict

    if not isinstance(dsn, str) or not dsn.strip():
        raise PostgresConnectionError(
            "The connection string is empty; use postgresql://USER:PASSWORD@HOST:PORT/DATABASE."
        )
    scheme, sep, rest = dsn.partition("://")
    is_url = bool(sep and scheme) and all(
        c.isascii() and (c.isalnum() or c in "+-.") for c in scheme
    )
    has_password = False
    text = dsn
    if is_url:
        if scheme.lower().split("+", 1)[0] not in ("postgresql", "postgres"):
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
            rest = f"{userinfo}@{rest[at + 1 :]}"
        text = f"postgresql://{rest}"
    try:
        params = {k: str(v) for k, v in conninfo_to_dict(text).items()}
    except Exception:  # noqa: BLE001 - the parser's message can quote the string
        raise PostgresConnectionError(
            "The connection string cannot be parsed (not shown: it may hold a password); use "
            "postgresql://USER:PASSWORD@HOST:PORT/DATABASE (percent-encode '%' as %25) or "
            "libpq's key=value form."
        ) from None
    return params, is_url, has_password or any(k in params for k in _SECRET_KEYS)


def dsn_params(dsn: str) -> dict[str, str]:
    """The libpq connection parameters of ``dsn`` (URL or key=value)."""
    return _parse(dsn)[0]


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by ``***``, rebuilt from libpq's parse of it (a
    string that cannot be parsed is not shown at all)."""
    from psycopg.conninfo import make_conninfo

    try:
        params, is_url, _ = _parse(dsn)
    except PostgresConnectionError:
        return "<connection string not shown: it cannot be parsed>"
    if not is_url:
        order = ["host", "port", "user", "password", "dbname"]
        keys = [k for k in order if k in params] + [k for k in params if k not in order]
        return make_conninfo(**{k: ("***" if k in _SECRET_KEYS else params[k]) for k in keys})
    # SQLAlchemy percent-encodes "/" in query values; a socket folder stays readable.
    base, sep, query = sqlalchemy_url(dsn, "", hide_password=True).partition("?")
    return base + sep + query.replace("%2F", "/")


def scrub(message: str, dsn: str) -> str:
    """``message`` with the DSN and its passwords (plain and URL-quoted) blanked out."""
    from urllib.parse import quote, quote_plus

    out = message.replace(dsn, mask_dsn(dsn)) if dsn else message
    try:
        params = dsn_params(dsn)
    except PostgresConnectionError:
        params = {}
    for secret in {params[k] for k in _SECRET_KEYS if params.get(k)}:
        for form in (secret, quote(secret, safe=""), quote_plus(secret)):
            out = out.replace(form, "***")
    return out


def sqlalchemy_url(dsn: str, driver: str = "psycopg", *, hide_password: bool = False) -> str:
    """``dsn`` as a SQLAlchemy URL with the given driver (``""``: none), built from libpq's
    parse of it, so both read the same user, password and host: one TCP host and its numeric
    port in the netloc, everything else (socket folders, host lists) in the query.
    ``hide_password`` shows a password field (an empty one too) as ``***`` and drops
    ``sslpassword``."""
    from sqlalchemy.engine import URL

    params, _, has_password = _parse(dsn)
    password = params.pop("password", None)
    if hide_password:
        password = "***" if has_password else None
        params.pop("sslpassword", None)
    user, host = params.pop("user", None), params.pop("host", None)
    port, dbname = params.pop("port", None), params.pop("dbname", None)
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


def first_line(exc: BaseException, dsn: str) -> str:
    """The first line of ``exc``'s message (its type when empty), password scrubbed."""
    text = str(exc).strip()
    return scrub(text.splitlines()[0].strip() if text else type(exc).__name__, dsn)


def query_error(exc: BaseException, dsn: str, action: str) -> PostgresQueryError:
    """One sentence for a driver error while doing ``action`` (password scrubbed)."""
    reason = first_line(getattr(exc, "orig", None) or exc, dsn).rstrip(".")
    code = sqlstate_of(exc) or ""
    hint = _SQLSTATE_HINTS.get(code) or _SQLSTATE_HINTS.get(code[:2])
    hint = hint or f"see the server log for details (SQLSTATE {code or 'unknown'})"
    return PostgresQueryError(f"Postgres at {mask_dsn(dsn)} refused to {action}: {reason}; {hint}.")


@contextmanager
def database_errors(dsn: str, action: str) -> Iterator[None]:
    """Driver errors raised inside the block as one-sentence :class:`PostgresQueryError` errors."""
    try:
        yield
    except (PostgresConnectionError, PostgresSetupError):
        raise
    except Exception as exc:
        if not is_driver_error(exc):
            raise
        raise query_error(exc, dsn, action) from None
