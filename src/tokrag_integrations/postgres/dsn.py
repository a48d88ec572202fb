"""Connection strings: libpq's reading of them, shown with the password masked.

Parsing is libpq's (``psycopg.conninfo.conninfo_to_dict``); key=value strings are rendered by
``psycopg.conninfo.make_conninfo``; URLs, shown or not, by SQLAlchemy's ``URL``
(``render_as_string(hide_password=True)`` for the masked form). Written here, because the
libraries lack it:

* lenient URL credentials (:func:`_parse`): libpq refuses a URL whose password holds ``@ / ?
  #`` written as they are, which users paste; the user-info part is re-encoded first;
* two touches to SQLAlchemy's masked URL (:func:`mask_dsn`): it drops an empty password
  field (``alice:@db``), so a mask would not show that one was given, and it percent-encodes
  ``/`` in query values, so a socket folder (``?host=/tmp/pg``) would not stay readable;
* :func:`_scrub`: removing a password from a driver's error message (no library does);
* the split of libpq's parameters into a URL's netloc and query (:func:`_url`): SQLAlchemy
  takes one TCP host and a numeric port, libpq also socket folders and host lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import (
    _SQLSTATE_HINTS,
    PostgresConnectionError,
    PostgresQueryError,
    PostgresSetupError,
    is_driver_error,
    sqlstate_of,
)

__all__ = [
    "database_errors",
    "dsn_params",
    "libpq_conninfo",
    "mask_dsn",
    "query_error",
    "sqlalchemy_url",
]

#: Connection parameters whose values are secrets (never shown).
_SECRET_KEYS = frozenset({"password", "sslpassword"})
_URL_SCHEMES = ("postgresql", "postgres")

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

    URLs come back as URLs (rendered by SQLAlchemy's ``URL.render_as_string(hide_password=
    True)``) and key=value strings as key=value strings (``psycopg.conninfo.make_conninfo``);
    a string that cannot be parsed is not shown at all.

    >>> mask_dsn("postgresql://alice:s3cret@db.example:5432/rag")
    'postgresql://alice:***@db.example:5432/rag'
    >>> mask_dsn("host=db user=alice password='a b' dbname=rag")
    'host=db user=alice password=*** dbname=rag'
    """
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
    # An empty password field (``alice:@db``) is shown as ``***`` too: SQLAlchemy would drop it.
    text = _url(rest, "", "***" if has_password else None).render_as_string(hide_password=True)
    # SQLAlchemy percent-encodes "/" in query values; a socket folder stays readable.
    base, sep, query = text.partition("?")
    return base + sep + query.replace("%2F", "/")


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


def _url(params: dict[str, str], driver: str, password: str | None) -> Any:
    """A SQLAlchemy ``URL`` from libpq parameters: a TCP host (one, not a socket folder) and
    its numeric port in the URL's netloc, everything else in its query."""
    from sqlalchemy.engine import URL

    params = dict(params)
    user = params.pop("user", None)
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
    return URL.create(
        f"postgresql+{driver}" if driver else "postgresql",
        username=user,
        password=password,
        host=url_host,
        port=url_port,
        database=dbname,
        query=query,
    )


def sqlalchemy_url(dsn: str, driver: str = "psycopg", *, hide_password: bool = False) -> str:
    """``dsn`` (URL or key=value) as a SQLAlchemy URL with the given driver.

    Built from libpq's parse of ``dsn`` (:func:`dsn_params`), so SQLAlchemy and libpq read
    the same user, password and host. ``hide_password=True`` renders the password (and an
    ``sslpassword``) as ``***``.
    """
    params = dsn_params(dsn)
    password = params.pop("password", None)
    if hide_password and "sslpassword" in params:
        params["sslpassword"] = "***"
    return _url(params, driver, password).render_as_string(hide_password=hide_password)


def libpq_conninfo(dsn: str) -> str:
    """``dsn`` as a libpq ``key=value`` string (what psycopg connects with)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(**dsn_params(dsn))


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
