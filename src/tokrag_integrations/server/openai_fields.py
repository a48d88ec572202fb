"""The OpenAI chat fields beyond plain text, as pydantic models of the request body: messages
with tool calls and tool results, ``tools`` and ``tool_choice``, ``response_format``, and the
``tokrag.constraint`` extension (a regex or a grammar). Each checks its shape and refuses with
one sentence naming the field (:func:`~.refusals.refusal`); :mod:`.schemas` assembles them
into the body.

Shapes follow OpenAI's Chat Completions reference: a tool is
``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``; a call
in an assistant message ``{"id", "type": "function", "function": {"name", "arguments"}}`` with
``arguments`` a JSON string holding an object; a tool result
``{"role": "tool", "tool_call_id", "content"}``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .refusals import Strict, refuse, type_name

__all__ = ["ConstraintField", "Message", "ResponseFormat", "Tool", "checked_tool_choice"]

#: OpenAI's rule for a function's name.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


def _text(content: Any) -> str:
    """A message's content as one string: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(
            "{where} must be a string or a list of text parts, got " + type_name(content)
        )
    parts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else part
        if not isinstance(text, str):
            kind = part.get("type") if isinstance(part, Mapping) else type_name(part)
            raise refuse(f"{{where}}[{j}] is a {kind!r} part; this server reads text parts only")
        parts.append(text)
    return "".join(parts)


class FunctionCall(BaseModel):
    """The ``function`` of a tool call in an assistant message."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=NAME_PATTERN)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
        except ValueError:
            raise refuse("'{where}' must be a JSON string holding an object, got text that is "
                         "not JSON") from None
        if not isinstance(parsed, dict):
            raise refuse("'{where}' must be a JSON string holding an object, got a JSON "
                         + type_name(parsed))
        return value


class ToolCall(BaseModel):
    """One of an assistant message's ``tool_calls``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_dict(self) -> dict[str, Any]:
        """The call as chat templates take it (``arguments`` an object)."""
        return {"id": self.id, "type": "function", "function": {
            "name": self.function.name, "arguments": json.loads(self.function.arguments)}}


class Message(BaseModel):
    """One chat message; its content a string or a list of text parts. Assistant messages may
    hold ``tool_calls`` (content then may be null); ``tool`` messages answer one of them by
    ``tool_call_id``."""

    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any, info: ValidationInfo) -> str:
        if content is None and info.data.get("role") == "assistant":
            return ""
        return _text(content)

    @model_validator(mode="after")
    def _tool_fields(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise refuse(f"{{where}} is a {self.role} message; only assistant messages hold "
                         "tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise refuse("{where} is a tool message without the 'tool_call_id' of the call it "
                         "answers")
        return self

    def as_dict(self, names: Mapping[str, str]) -> dict[str, Any]:
        """The message as a conversation turn; a tool result gets the called tool's ``name``
        from ``names`` (call id -> name) when it gives none."""
        turn: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            turn["tool_calls"] = [c.as_dict() for c in self.tool_calls]
        if self.role == "tool":
            turn["tool_call_id"] = self.tool_call_id
            name = self.name or names.get(self.tool_call_id or "")
            if name:
                turn["name"] = name
        return turn


class FunctionSpec(Strict):
    """A tool's ``function``: its name, what it does, its arguments' JSON schema."""

    _what: ClassVar[str] = "a function takes"
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    """One of ``tools``."""

    _what: ClassVar[str] = "a tool takes"
    type: Literal["function"]
    function: FunctionSpec

    def as_dict(self) -> dict[str, Any]:
        """The tool in OpenAI's shape, unset keys left out (``parameters`` defaults to an
        object without properties)."""
        f = self.function.model_dump(exclude_none=True)
        f.setdefault("parameters", {"type": "object", "properties": {}})
        return {"type": "function", "function": f}


#: ``tool_choice``'s words.
TOOL_CHOICE_WORDS = ("auto", "none", "required")


def checked_tool_choice(value: Any) -> str:
    """``tool_choice`` as one word: ``auto``, ``none``, ``required``, or the name of the
    function ``{"type": "function", "function": {"name": ...}}`` names (a refusal otherwise)."""
    shape = ("'{where}' must be 'auto', 'none', 'required' or an object "
             '{"type": "function", "function": {"name": ...}}')
    if isinstance(value, str):
        if value not in TOOL_CHOICE_WORDS:
            raise refuse(f"{shape}, got {value[:80]!r}")
        return value
    function = value.get("function") if isinstance(value, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if (
        not isinstance(value, Mapping) or value.get("type") != "function"
        or set(value) != {"type", "function"} or not isinstance(function, Mapping)
        or set(function) != {"name"} or not isinstance(name, str)
    ):
        raise refuse(shape)
    return name


class JsonSchemaFormat(Strict):
    """``response_format.json_schema``: the schema the answer must follow."""

    _what: ClassVar[str] = "json_schema takes"
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - {"name", "description", "schema", "strict"})
            if unknown:
                raise refuse(f"'{{where}}' has unknown key(s) {', '.join(unknown)}; "
                             "json_schema takes name, description, schema, strict")
        return value


class ResponseFormat(BaseModel):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            raise refuse("'{where}' must be an object such as {\"type\": \"json_object\"}, got "
                         + type_name(value))
        unknown = sorted(set(value) - {"type", "json_schema"})
        if unknown:
            raise refuse(f"'{{where}}' has unknown key(s) {', '.join(unknown)}; it takes type "
                         "and, for type json_schema, json_schema")
        if value.get("type") == "json_schema" and not isinstance(value.get("json_schema"), Mapping):
            raise refuse("'{where}' of type json_schema needs a 'json_schema' object with "
                         "'name' and 'schema'")
        if value.get("type") != "json_schema" and "json_schema" in value:
            raise refuse("'{where}' has 'json_schema' but its type is not json_schema")
        return value

    def spec(self) -> dict[str, Any] | None:
        """The engine's constraint spec (None for ``text``: no constraint)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        js = self.json_schema
        assert js is not None  # checked by _shape
        inner = {"name": js.name, "schema": js.schema_ if js.schema_ is not None else {}}
        if js.strict is not None:
            inner["strict"] = js.strict
        return {"type": "json_schema", "json_schema": inner}


class ConstraintField(BaseModel):
    """``tokrag.constraint``: a regular expression or a Lark grammar the answer must match
    (JSON goes through ``response_format``)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["regex", "grammar"]
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_pattern(self) -> ConstraintField:
        given = getattr(self, self.type)
        other = "grammar" if self.type == "regex" else "regex"
        if not isinstance(given, str) or not given or getattr(self, other) is not None:
            raise refuse(f"'{{where}}' of type {self.type} takes a non-empty '{self.type}' "
                         f"string and no '{other}'")
        return self

    def spec(self) -> dict[str, Any]:
        return {"type": self.type, self.type: getattr(self, self.type)}
