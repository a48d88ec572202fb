"""Every environment variable tokrag reads, in one place.

Each variable has one accessor here that reads the environment when it is called (not at
import), so a variable set after import, or by a test, takes effect on the next call. A value
that cannot be used raises :class:`ConfigError` (a ``ValueError``) naming the variable, the
value and what it should be; an unset or empty variable means its default. The variables, their
defaults and meanings are tabled in README.md ("Environment variables"; the speed
variables in docs/speed.md). Switches take
``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` in any case; any other word is
an error rather than a silent *yes*.

Also here: the cache folder (:func:`cache_dir`), :func:`require_bool` (a boolean argument of
the Python API: ``True`` or ``False`` only), :func:`bool_word`, the one reading of a boolean
given as text (options, ``speed=`` fields, switches). The ``TOKRAG_*`` speed variables are the
defaults of :class:`..speed.Speed`'s fields. This module imports only the standard library, so
anything may import it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

API_KEY = "TOKRAG_API_KEY"
CACHE_DIR = "TOKRAG_CACHE_DIR"
DATA_DIR = "TOKRAG_DATA_DIR"
PG_DSN = "TOKRAG_PG_DSN"
STREAM_IDLE_TIMEOUT = "TOKRAG_STREAM_IDLE_TIMEOUT"
VERBOSE = "TOKRAG_VERBOSE"
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0

#: Booleans as words (case and outer spaces aside): an option given as text (``--option
#: lens_norm=false``, a ``speed=`` dict) takes these four ...
_BOOL_WORDS = {"1": True, "true": True, "0": False, "false": False}
#: ... and an on/off environment variable these four more.
_SWITCH_WORDS = {**_BOOL_WORDS, "yes": True, "on": True, "no": False, "off": False}
_MODES = ("auto", "on", "off")


class ConfigError(ValueError):
    """An environment variable holds a value tokrag cannot use (the message names it)."""


def require_bool(value: Any, name: str) -> bool:
    """``value`` when it is ``True`` or ``False``; otherwise a ``TypeError`` naming ``name``.

    Every public boolean option is read this way, never by truthiness: ``bool("False")`` is
    ``True``, and ``trust_remote_code="False"`` must not run a model folder's code.
    """
    if isinstance(value, bool):
        return value
    raise TypeError(
        f"{name} must be True or False, got {value!r} ({type(value).__name__}); strings are not "
        "read as booleans."
    )


def bool_word(value: Any, *, switch: bool = False) -> bool | None:
    """The one reading of a boolean given as data: ``True``/``False``, the integers 1/0, or a
    word (``true``/``false``/``1``/``0``; with ``switch``, an environment variable's, also
    ``yes``/``no``/``on``/``off``) in any case. None for anything else: the caller refuses it in
    its own words (:func:`option_bool`, :func:`env_switch`, the policy registry)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return (_SWITCH_WORDS if switch else _BOOL_WORDS).get(value.strip().lower())
    return None


def option_bool(name: str, value: Any) -> bool:
    """:func:`bool_word` of the option ``name``, or a ``ValueError`` naming it."""
    got = bool_word(value)
    if got is None:
        raise ValueError(f"{name} must be True or False (or 1/0), got {value!r}")
    return got


def _raw(name: str) -> str | None:
    """The variable's value without surrounding spaces; ``None`` when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def _bad(name: str, raw: str, what: str, fix: str, default: object) -> ConfigError:
    return ConfigError(
        f"{name} must be {what}, got {raw!r} ({name}={raw!r} in the environment); {fix}, or "
        f"unset it for the default ({default})."
    )


def env_switch(name: str, default: bool) -> bool:
    """The variable ``name`` read as an on/off switch; ``default`` when unset or empty.

    Raises:
        ConfigError: The value is not one of the switch words (module docstring).
    """
    raw = _raw(name)
    if raw is None:
        return default
    got = bool_word(raw, switch=True)
    if got is None:
        raise ConfigError(
            f"{name}={raw!r} is not a switch; set it to 1, true, yes or on, or to 0, false, no "
            "or off (or unset it)."
        )
    return got


def _mode(name: str) -> str:
    raw = _raw(name)
    if raw is None:
        return "auto"
    if raw.lower() not in _MODES:
        raise _bad(name, raw, "'auto', 'on' or 'off'", "set it to one of them", "auto")
    return raw.lower()


def _positive(name: str, kind: type, default: float, what: str, finite: bool = True) -> float:
    """A positive number of type ``kind`` (``int``: a whole number) or ``default``; infinity
    only where ``finite`` is false (a wait that never gives up)."""
    raw = _raw(name)
    if raw is None:
        return kind(default)
    try:
        value = float(raw) if kind is float else int(raw)
    except ValueError:
        value = float("nan")
    if math.isnan(value) or value <= 0 or (finite and math.isinf(value)):
        raise _bad(name, raw, what, "set it to a number above 0", kind(default))
    return kind(value)


def api_key() -> str | None:
    """``$TOKRAG_API_KEY`` as given (set but empty: ``""``, which ``tokrag serve`` refuses):
    the bearer token of ``tokrag serve``, or ``None`` when unset."""
    return os.environ.get(API_KEY)


def cache_dir() -> Path:
    """tokrag's cache folder (converted models, chunk embeddings, kernel plans):
    ``$TOKRAG_CACHE_DIR``, else ``$XDG_CACHE_HOME/tokrag``, else ``~/.cache/tokrag``."""
    raw = os.environ.get(CACHE_DIR)
    if raw:
        return Path(raw)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "tokrag"


class CacheDirError(OSError):
    """tokrag's cache folder cannot be created or written (the message names the folder and
    ``$TOKRAG_CACHE_DIR``)."""


def cache_write_error(error: OSError, what: str, folder: Path) -> OSError:
    """The error for writing ``what`` into ``folder`` failing with ``error``: a
    :class:`CacheDirError` naming ``$TOKRAG_CACHE_DIR`` when ``folder`` is inside the cache
    folder, else an ``OSError`` naming ``folder``."""
    reason = f"{error.strerror or error}: {error.filename or folder}"
    root = cache_dir()
    if Path(os.path.abspath(folder)).is_relative_to(os.path.abspath(root)):
        return CacheDirError(
            f"Cannot write {what} into tokrag's cache folder {root} ({reason}); set "
            f"${CACHE_DIR} to a writable folder."
        )
    return OSError(f"Cannot write {what} into {folder} ({reason}).")


def xdg_data_home() -> Path | None:
    """``$XDG_DATA_HOME``, or ``None``."""
    raw = os.environ.get("XDG_DATA_HOME")
    return Path(raw) if raw else None


def cpu_kernels() -> str:
    return _mode("TOKRAG_CPU_KERNELS")


def packed_head() -> str:
    return _mode("TOKRAG_PACKED_HEAD")


def data_dir() -> Path | None:
    """``$TOKRAG_DATA_DIR`` with ``~`` expanded, or ``None`` (the embedded Postgres lives in
    ``<it>/pg``; ``tokrag bench`` without ``--data`` reads ``<it>/squad_dev.jsonl``)."""
    raw = os.environ.get(DATA_DIR)
    return Path(raw).expanduser() if raw else None


def fuse_contexts() -> bool:
    return env_switch("TOKRAG_FUSE_CONTEXTS", True)


def kernel_plan_cache() -> bool:
    return env_switch("TOKRAG_KERNEL_PLAN_CACHE", True)


def packed_prefill() -> bool:
    return env_switch("TOKRAG_PACKED_PREFILL", True)


def split_prefill() -> bool:
    return env_switch("TOKRAG_SPLIT_PREFILL", True)


def verbose() -> bool:
    return env_switch(VERBOSE, False)


def pg_dsn() -> str | None:
    """``$TOKRAG_PG_DSN`` as given (it may hold a password: never print it), or ``None``."""
    return os.environ.get(PG_DSN) or None


def pg_connect_timeout() -> int:
    """``$TOKRAG_PG_CONNECT_TIMEOUT`` in whole seconds, rounded up (at least 1; default 5)."""
    value = _positive("TOKRAG_PG_CONNECT_TIMEOUT", float, 5, "a number of seconds")
    return max(1, math.ceil(value))


def pg_pool_size() -> int:
    return int(_positive("TOKRAG_PG_POOL_SIZE", int, 10, "a whole number"))


def pg_pool_timeout() -> float:
    return _positive("TOKRAG_PG_POOL_TIMEOUT", float, 30, "a number of seconds", finite=False)


def stream_idle_timeout() -> float:
    """``$TOKRAG_STREAM_IDLE_TIMEOUT`` in seconds (default 30)."""
    return _positive(
        STREAM_IDLE_TIMEOUT, float, DEFAULT_STREAM_IDLE_TIMEOUT_S, "a number of seconds",
        finite=False,
    )
