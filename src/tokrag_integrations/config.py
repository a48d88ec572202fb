"""Every environment variable tokrag reads, in one place.

Each variable has one accessor here that reads the environment when it is called (not at
import), so a variable set after import, or by a test, takes effect on the next call. A value
that cannot be used raises :class:`ConfigError` (a ``ValueError``) naming the variable, the
value and what it should be; an unset or empty variable means its default. The variables, their
defaults and meanings are tabled in README.md ("Environment variables"). Switches take
``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` in any case; any other word is
an error rather than a silent *yes*.

Also here: the cache folder (:func:`cache_dir`), :func:`require_bool`, the strict reading
of boolean options, and :class:`Speed`, how fast a decode runs (the ``speed=`` argument),
whose fields' defaults are the ``TOKRAG_*`` speed variables. This module imports only the
standard library, so anything may import it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

API_KEY = "TOKRAG_API_KEY"
CACHE_DIR = "TOKRAG_CACHE_DIR"
DATA_DIR = "TOKRAG_DATA_DIR"
PG_DSN = "TOKRAG_PG_DSN"
STREAM_IDLE_TIMEOUT = "TOKRAG_STREAM_IDLE_TIMEOUT"
VERBOSE = "TOKRAG_VERBOSE"
DEFAULT_STREAM_IDLE_TIMEOUT_S = 30.0

_SWITCH_WORDS = {
    "1": True, "true": True, "yes": True, "on": True,
    "0": False, "false": False, "no": False, "off": False,
}
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
    try:
        return _SWITCH_WORDS[raw.lower()]
    except KeyError:
        raise ConfigError(
            f"{name}={raw!r} is not a switch; set it to 1, true, yes or on, or to 0, false, no "
            "or off (or unset it)."
        ) from None


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


# ---------------------------------------------------------------------- speed=
# How fast a decode runs, chosen apart from what it decides: the ``speed=`` argument.
# 
# Every entry point takes one ``speed=``: a :class:`Speed`, a preset name or a dict of its
# fields. Every choice gives the tokens, sources and decisions of the step-by-step loop
# (``benchmarks/exactness.py`` checks it); they differ in time only.
# 
# Presets: ``"auto"`` (the default: every field at its default) and ``"reference"`` (the
# step-by-step loop as written: one forward pass per context per step, no logit-lens rows
# shared between the queries of a batch).
# 
# This is the one place where the ``TOKRAG_*`` speed variables are read: each is the default
# of one field (read when the :class:`Speed` is made, so a variable set later applies to the
# next decode). The speed paths read their choices from a :class:`Speed` only.

_SPEED_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}
_SPEED_MODE_FIELDS = ("cpu_kernels", "packed_head")


@dataclass(frozen=True)
class Speed:
    """The speed paths of one decode (and of a model's load: ``cpu_kernels``).

    Args:
        fuse: decode the contexts of a query as one batch (one forward pass per step)
            where the model allows it; False: one pass per context role
            (``TOKRAG_FUSE_CONTEXTS``, default on).
        packed_prefill: one query's two contexts as one packed sequence
            (``TOKRAG_PACKED_PREFILL``, default on; needs ``fuse``).
        split_prefill: on CPU, prefill a batch's queries a few at a time, then merge them
            (``TOKRAG_SPLIT_PREFILL``, default on).
        share_lens: in a batch, the first logit-lens rows of every query in one product.
        cpu_kernels: ``"auto"`` (measured few-row plans), ``"on"`` or ``"off"``: the CPU
            kernels a float32 model gets when loaded (``TOKRAG_CPU_KERNELS``).
        packed_head: ``"auto"`` (where measured faster), ``"on"`` or ``"off"``: the packed
            LM head of the logit lens on CPU (``TOKRAG_PACKED_HEAD``).
        kernel_plan_cache: keep measured kernel plans on disk for later processes
            (``TOKRAG_KERNEL_PLAN_CACHE``, default on).
    """

    fuse: bool = field(default_factory=fuse_contexts)
    packed_prefill: bool = field(default_factory=packed_prefill)
    split_prefill: bool = field(default_factory=split_prefill)
    share_lens: bool = True
    cpu_kernels: str = field(default_factory=cpu_kernels)
    packed_head: str = field(default_factory=packed_head)
    kernel_plan_cache: bool = field(default_factory=kernel_plan_cache)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SPEED_MODE_FIELDS:
                if value not in _MODES:
                    raise ValueError(f"{f.name} must be 'auto', 'on' or 'off', got {value!r}")
            elif not isinstance(value, bool):
                raise ValueError(f"{f.name} must be True or False, got {value!r}")

    def options(self) -> dict[str, Any]:
        """The speed as the trace records it (``Trace.speed``, never the rule's options)."""
        return {"fuse": self.fuse}


#: The named presets of ``speed=``: the fields each sets (the others keep their defaults).
PRESETS: dict[str, dict[str, Any]] = {
    "auto": {},
    "reference": {"fuse": False, "share_lens": False},
}


def _as_bool(name: str, value: Any) -> bool:
    """``value`` read strictly as a bool: True/False, 1/0 or the strings true/false/1/0 (a
    dict of options may come from a command line); anything else is an error."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _SPEED_BOOL_WORDS:
        return _SPEED_BOOL_WORDS[value.strip().lower()]
    raise ValueError(f"{name} must be True or False (or 1/0), got {value!r}")


def speed_of(value: Speed | str | Mapping[str, Any] | None = None) -> Speed:
    """``speed=`` as a :class:`Speed`: a Speed as is, None or a preset name (``"auto"``,
    ``"reference"``), or a dict of fields (``{"fuse": False}``; the fields not named keep
    their defaults; a bool field may be given as ``"true"``/``"0"``...).

    Raises:
        ValueError: an unknown preset or field, or a field's bad value (one sentence).
    """
    if value is None:
        return Speed()
    if isinstance(value, Speed):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(
                f"unknown speed preset {value!r}; presets: {', '.join(PRESETS)} "
                "(or a dict of Speed fields)"
            )
        return Speed(**PRESETS[value])
    if isinstance(value, Mapping):
        fields = {f.name: f for f in dataclasses.fields(Speed)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(
                f"unknown speed option {unknown[0]!r}; options: {', '.join(sorted(fields))}"
            )
        given = {
            k: str(v).strip().lower() if k in _SPEED_MODE_FIELDS else _as_bool(k, v) for k, v in value.items()
        }
        return Speed(**given)
    raise TypeError(
        f"speed must be a Speed, a preset name or a dict, got {type(value).__name__}"
    )
