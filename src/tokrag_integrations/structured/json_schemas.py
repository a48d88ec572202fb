"""JSON schemas: from what users pass (a pydantic class, a TypedDict, a dict), to the grammar
that constrains decoding, and back from the decoded text to a value.

Two choices shape the grammar (both documented in docs/structured.md):

* **Closed objects.** An object schema that lists ``properties`` and says nothing about
  ``additionalProperties`` is closed (``additionalProperties: false``) before it is compiled,
  as xgrammar's ``strict_mode`` (on by default in its ``Grammar.from_json_schema``) does: a
  small model given room for keys the schema never named tends to invent them for ever. The
  output still validates against the schema as written: closing only narrows it.
* **Compact, fixed whitespace.** ``{"a": 1, "b": [2, 3]}``: items separated by ``", "``, keys by
  ``": "``, no other whitespace (llguidance's default lets any run of whitespace in, where a
  small model can loop on newlines). A schema's own ``"x-guidance"`` options override this.
"""

from __future__ import annotations

import json
import sys
import typing
from collections.abc import Mapping
from typing import Any

from .llguidance_backend import llguidance_module

#: llguidance's JSON options used unless the schema's ``x-guidance`` says otherwise.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keywords whose value is a schema, or a list / map of schemas, that closing walks into. allOf
# is left out on purpose: closing each branch of an intersection would reject the properties
# the other branches add.
_SCHEMA_VALUED = ("items", "additionalItems", "contains", "not", "if", "then", "else",
                  "additionalProperties", "unevaluatedItems", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema with ``properties`` and no
    ``additionalProperties`` / ``patternProperties`` / ``unevaluatedProperties`` says
    ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_VALUED:
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(v) for k, v in out[key].items()}
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def check_schema(schema: Any, name: str) -> None:
    """ValueError (one sentence naming ``name`` and the problem) unless ``schema`` is a valid
    JSON schema (checked against its metaschema by ``jsonschema`` when that is installed;
    llguidance checks what it compiles in any case)."""
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema {name!r} must be an object (a dict), got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - installed with the structured extra
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise ValueError(
            f"the JSON schema {name!r} is not valid{f' at {where}' if where else ''}: {exc.message}"
        ) from None


def json_grammar(schema: dict[str, Any]) -> str:
    """llguidance's grammar text for JSON valid against ``schema`` (closed, compact)."""
    llg = llguidance_module()
    return llg.LLMatcher.grammar_from_json_schema(closed_schema(schema), defaults=dict(JSON_OPTIONS))


def schema_from_response_format(spec: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """``(schema, name)`` of a ``{"type": "json_schema", "json_schema": {...}}`` spec, checked."""
    inner = spec.get("json_schema")
    if not isinstance(inner, Mapping):
        raise ValueError(
            'a json_schema constraint needs "json_schema": {"name": ..., "schema": {...}} '
            "(OpenAI's response_format shape)"
        )
    name = inner.get("name") or "response"
    if not isinstance(name, str):
        raise ValueError(f"json_schema.name must be a string, got {type(name).__name__}")
    if "schema" not in inner:
        raise ValueError(f'the json_schema {name!r} has no "schema" (put the JSON schema under json_schema.schema)')
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"json_schema.strict must be true or false, got {strict!r}")
    schema = inner["schema"]
    check_schema(schema, name)
    return dict(schema), name


def _is_pydantic_model(obj: Any) -> bool:
    return isinstance(obj, type) and hasattr(obj, "model_json_schema") and hasattr(obj, "model_validate_json")


def _is_typed_dict(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, dict) and hasattr(obj, "__annotations__") and hasattr(
        obj, "__total__"
    )


def _typed_dict_adapter(cls: Any) -> Any:
    """pydantic's ``TypeAdapter`` of a TypedDict class. pydantic reads ``typing.TypedDict``
    only on Python 3.12+; before that the class is rebuilt as a ``typing_extensions`` one with
    the same keys, types and required keys."""
    try:
        from pydantic import TypeAdapter
    except ImportError as exc:  # pragma: no cover - pydantic comes with the frameworks
        raise ImportError("a TypedDict schema needs pydantic: pip install pydantic") from exc
    if sys.version_info < (3, 12) and type(cls).__module__ == "typing":
        import typing_extensions

        hints = typing.get_type_hints(cls, include_extras=True)
        required = getattr(cls, "__required_keys__", frozenset(hints))
        fields = {k: t if k in required else typing_extensions.NotRequired[t] for k, t in hints.items()}
        rebuilt = typing_extensions.TypedDict(cls.__name__, fields)  # type: ignore[operator]
        rebuilt.__doc__ = cls.__doc__
        cls = rebuilt
    return TypeAdapter(cls)


def json_schema_of(schema: Any) -> tuple[dict[str, Any], str]:
    """``(JSON schema, name)`` of a pydantic model class, a TypedDict class or a JSON-schema dict.

    A dict may also be OpenAI's wrapper (``{"name": ..., "schema": {...}}``) or a whole
    ``response_format`` (``{"type": "json_schema", "json_schema": {...}}``); its name is the
    wrapper's ``name``, else the schema's ``title``, else ``"response"``.
    """
    if _is_pydantic_model(schema):
        return schema.model_json_schema(), schema.__name__
    if _is_typed_dict(schema):
        return _typed_dict_adapter(schema).json_schema(), schema.__name__
    if isinstance(schema, Mapping):
        if schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), Mapping):
            return schema_from_response_format(schema)
        if isinstance(schema.get("schema"), Mapping) and "properties" not in schema:
            return schema_from_response_format({"json_schema": schema})
        name = schema.get("title") if isinstance(schema.get("title"), str) else "response"
        check_schema(dict(schema), name)
        return dict(schema), name
    raise TypeError(
        "a schema must be a pydantic model class, a TypedDict class or a JSON-schema dict, "
        f"got {schema!r}"
    )


def response_format_of(schema: Any, strict: bool | None = True) -> dict[str, Any]:
    """OpenAI's ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` for any
    schema :func:`json_schema_of` reads (the spec :func:`.grammar.constraint_for` takes)."""
    body, name = json_schema_of(schema)
    inner: dict[str, Any] = {"name": name, "schema": body}
    if strict is not None:
        inner["strict"] = strict
    return {"type": "json_schema", "json_schema": inner}


def parse_structured(text: str, schema: Any = None) -> Any:
    """The value of ``text``, a JSON document: a pydantic instance for a pydantic class, a dict
    (validated) for a TypedDict or a JSON schema, the parsed JSON when ``schema`` is None.

    Raises ValueError (one sentence, naming the schema) when the text is not JSON or does not
    validate; the exception's ``__cause__`` holds the validator's own error.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_structured takes the generated text (a str), got {type(text).__name__}")
    if _is_pydantic_model(schema):
        try:
            return schema.model_validate_json(text.strip())
        except ValueError as exc:
            raise ValueError(f"the output does not validate against {schema.__name__}: {_brief(exc)}") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the output is not JSON ({exc.msg} at character {exc.pos}): {text[:80]!r}") from exc
    if schema is None:
        return value
    if _is_typed_dict(schema):
        try:
            return _typed_dict_adapter(schema).validate_python(value)
        except ValueError as exc:
            raise ValueError(f"the output does not validate against {schema.__name__}: {_brief(exc)}") from exc
    body, name = json_schema_of(schema)
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - installed with the structured extra
        raise ImportError("validating against a JSON schema needs jsonschema: pip install jsonschema") from exc
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(body)(body).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise ValueError(
            f"the output does not validate against {name!r}{f' at {where}' if where else ''}: {error.message}"
        )
    return value


def _brief(exc: Exception) -> str:
    """The first error of a pydantic ValidationError (or any error's first line)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "the value"
            return f"{where}: {first.get('msg')}"
        except Exception:  # pragma: no cover - a ValidationError without errors
            pass
    return str(exc).strip().splitlines()[0]
