"""How the server refuses a request: :class:`RequestError` (an OpenAI-style error body naming
the field), the checks every decoded body passes before its fields are read
(:func:`check_json_values`: nesting, numbers, Unicode), the per-request :class:`Limits`, and the
pieces the request models of :mod:`.schemas` and :mod:`.openai_fields` share (the strict base
model, refusals worded by the server, pydantic's errors as one sentence: :func:`refusal`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "MAX_JSON_DEPTH", "Limits", "RequestError", "check_json_values", "refusal", "too_deep",
]


class RequestError(ValueError):
    """A request the server refuses: ``status`` (400 unless said), ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {message, type, param, code}}``."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": None}}


#: Deepest nesting of arrays and objects in a request body (an OpenAI chat body needs 4).
MAX_JSON_DEPTH = 32


def too_deep(where: str | None = None) -> RequestError:
    """The 400 of a body (or of its field ``where``) nested deeper than :data:`MAX_JSON_DEPTH`."""
    return RequestError(
        f"{where or 'the body'} nests arrays and objects deeper than this server's limit of "
        f"{MAX_JSON_DEPTH} levels", where
    )


def _path(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _number(value: Any, where: str) -> None:
    """Refuse NaN, the infinities (Python's JSON decoder reads ``NaN`` and ``Infinity``) and
    integers a float cannot hold (``10**400``): no field of the server takes them."""
    if isinstance(value, float) and not math.isfinite(value):
        got = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        got = f"an integer of {len(str(abs(value)))} digits"
    else:
        return
    raise RequestError(f"'{where}' must be a finite number of at most "
                       f"{sys.float_info.max:.1e} in size, got {got}", where)


def _unicode(text: str, where: str, what: str = "") -> None:
    """Refuse a string with a lone surrogate (JSON's ``"\\ud800"`` escape decodes to one): no
    tokenizer, database or client takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        name = f"'{where}'" if where else "the body"
        raise RequestError(
            f"{name}{what} is not valid Unicode: it holds the lone surrogate "
            f"{ascii(text[exc.start])} at position {exc.start}", where or None
        ) from None


def check_json_values(body: Any) -> None:
    """Refuse (:class:`RequestError` naming the field) a decoded body nested deeper than
    :data:`MAX_JSON_DEPTH` (deep metadata would fail in the response, after the whole decode),
    or holding a number out of range (NaN, infinite, too large for a float) or a string that
    is not valid Unicode."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, Mapping):
            items: Any = value.items()
            for key in value:
                _unicode(key, where, " has a key that")
        elif isinstance(value, list):
            items = enumerate(value)
        elif isinstance(value, str):
            _unicode(value, where)
            continue
        else:
            _number(value, where)
            continue
        if depth > MAX_JSON_DEPTH:
            raise too_deep(where or None)
        stack.extend((v, _path(where, k), depth + 1) for k, v in items)


@dataclass
class Limits:
    """Per-request limits of the server (``tokrag serve`` flags of the same names)."""

    max_tokens: int = 512
    """Largest ``max_tokens`` a request may ask for."""
    max_documents: int = 32
    """Most ``documents`` in one request."""
    max_messages: int = 64
    """Most chat messages in one request."""
    max_body_bytes: int = 1_000_000
    """Largest request body (checked by the app before the JSON is read)."""
    max_n: int = 8
    """Most choices (``n``) one request may ask for."""
    max_tools: int = 64
    """Most ``tools`` in one request."""


def type_name(value: Any) -> str:
    """``value``'s JSON type, as a refusal names it."""
    if value is None:
        return "null"
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array"}
    return names.get(type(value), "object" if type(value) is dict else type(value).__name__)


def refuse(sentence: str) -> PydanticCustomError:
    """A refusal worded by the server; ``{where}`` becomes the field's path."""
    return PydanticCustomError("refused", sentence)


def limits_of(info: ValidationInfo) -> Limits:
    """The limits a validation runs under (its context's, else the defaults)."""
    return (info.context or {}).get("limits") or Limits()


def at_most(value: Any, limit: int, what: str) -> Any:
    """``value`` unless it holds more than ``limit`` items (a refusal naming ``what``)."""
    if value is not None and len(value) > limit:
        raise refuse(
            f"'{{where}}' holds {len(value)} {what}, more than this server's limit of {limit}"
        )
    return value


class Strict(BaseModel):
    """Strict types (``"4"`` is not an integer, ``1`` is not true), unknown keys refused with
    the keys the object takes."""

    model_config = ConfigDict(strict=True, extra="forbid")
    _what: ClassVar[str] = "it takes"

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(cls.model_fields))
            if unknown:
                raise refuse(
                    f"'{{where}}' has unknown key(s) {', '.join(unknown)}; {cls._what} "
                    f"{', '.join(cls.model_fields)}"
                )
        return value


#: How pydantic's error types read in a refusal, one sentence naming the field: ``where`` (the
#: field), ``got`` (the value), ``type`` (its JSON type), ``short`` (its first 80 characters),
#: and the error's own context (``ge``, ``pattern``, ...).
_REFUSALS = {
    **{
        kind: f"'{{where}}' must be {what}, got {{type}}"
        for kind, what in (
            ("string_type", "a string"), ("int_type", "an integer"),
            ("bool_type", "true or false"), ("float_type", "a number"),
            ("dict_type", "an object"), ("model_type", "an object"), ("list_type", "an array"),
        )
    },
    "greater_than_equal": "'{where}' must be at least {ge}, got {got}",
    "less_than_equal": "'{where}' must be at most {le}, got {got}",
    "greater_than": "'{where}' must be above {gt}, got {got}",
    "literal_error": "{where} must be {expected}, got {got!r}",
    "string_pattern_mismatch": "'{where}' must match {pattern}, got {short!r}",
    "too_long": "'{where}' holds {actual_length} items; at most {max_length}",
    "missing": "'{where}' is required",
}  # fmt: skip


def refusal(error: Mapping[str, Any]) -> RequestError:
    """One pydantic error as the server's 400: one sentence naming the field."""
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in error["loc"]).lstrip(".")
    kind, got = error["type"], error.get("input")
    if kind == "refused":
        message = error["msg"].replace("{where}", where)
    elif kind in _REFUSALS:
        values = {"type": type_name(got), "short": str(got)[:80], **(error.get("ctx") or {})}
        message = _REFUSALS[kind].format_map({**values, "where": where, "got": got})
    else:
        message = f"'{where}': {error['msg']}"
    return RequestError(message, where or None)
