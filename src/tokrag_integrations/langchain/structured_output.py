"""``ChatTokRAG.with_structured_output``: a schema's JSON by constrained decoding.

``method="json_schema"`` (the default) binds ``response_format={"type": "json_schema", ...}``
(OpenAI's shape), which the engine compiles to a token mask
(:func:`tokrag_integrations.structured.constraint_for`) applied at each step to every context
of the query: the answer is JSON of the schema, whatever the policy, and the trace still says
which context each token came from. ``method="json_mode"`` binds ``{"type": "json_object"}``,
or the schema's own constraint when a schema is given (a local model then always gives JSON
the schema parses; OpenAI's JSON mode only promises an object). ``method="function_calling"``
is a forced call of the schema as a tool (:meth:`ChatTokRAG.bind_tools`), its arguments
parsed. The parsed value is a pydantic instance for a pydantic class, else a dict; with
``include_raw=True`` a dict ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import BaseOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema

from ..structured import json_schema_of, parse_structured

METHODS = ("json_schema", "json_mode", "function_calling")


def _pydantic_v1(schema: Any) -> bool:
    """Whether ``schema`` is a ``pydantic.v1`` model class (LangChain still takes them)."""
    try:
        from pydantic import v1
    except ImportError:  # pragma: no cover - pydantic 2 ships it
        return False
    return isinstance(schema, type) and issubclass(schema, v1.BaseModel)


def response_format(schema: Any) -> dict[str, Any]:
    """The ``response_format`` bound for ``schema`` (None: any JSON object)."""
    if schema is None:
        return {"type": "json_object"}
    if _pydantic_v1(schema):
        spec = convert_to_json_schema(schema)
        name = spec.get("title", schema.__name__)
    else:
        spec, name = json_schema_of(schema)
    return {"type": "json_schema", "json_schema": {"name": name, "schema": spec}}


class StructuredParser(BaseOutputParser[Any]):
    """An answer's JSON as ``schema`` (a pydantic class: an instance; else a dict). Yields once,
    at the end of a stream (a partial object is not the schema's)."""

    schema_: Any = None
    """The schema given to ``with_structured_output`` (None: any JSON)."""

    def parse(self, text: str) -> Any:
        try:
            if self.schema_ is None:
                return json.loads(text)
            if _pydantic_v1(self.schema_):
                return self.schema_.parse_raw(text)
            return parse_structured(text, self.schema_)
        except Exception as e:  # the parser's own error says what did not parse
            raise OutputParserException(
                f"The answer is not JSON of the schema ({e}); if it was cut by max_tokens, "
                "raise max_tokens.",
                llm_output=text,
            ) from e

    def parse_result(self, result: list[Any], *, partial: bool = False) -> Any:
        message = result[0].message if hasattr(result[0], "message") else None
        text = result[0].text
        if isinstance(message, BaseMessage) and message.response_metadata.get("finish_reason") == "length":
            raise OutputParserException(
                "The answer was cut at max_tokens before its JSON was complete: raise max_tokens.",
                llm_output=text,
            )
        return self.parse(text)

    @property
    def _type(self) -> str:
        return "tokrag_structured"


class ToolArgsParser(BaseOutputParser[Any]):
    """The first tool call's arguments as ``schema`` (``method="function_calling"``)."""

    schema_: Any = None

    def parse_result(self, result: list[Any], *, partial: bool = False) -> Any:
        message = result[0].message
        if not isinstance(message, AIMessage) or not message.tool_calls:
            raise OutputParserException(
                "The answer holds no tool call of the schema.", llm_output=result[0].text
            )
        return StructuredParser(schema_=self.schema_).parse(json.dumps(message.tool_calls[0]["args"]))

    def parse(self, text: str) -> Any:  # pragma: no cover - parse_result is what runs
        raise NotImplementedError("ToolArgsParser reads the message's tool calls")

    @property
    def _type(self) -> str:
        return "tokrag_tool_args"


def structured_runnable(
    model: Any, schema: Any, method: str, include_raw: bool, kwargs: dict[str, Any]
) -> Runnable:
    """The runnable ``with_structured_output`` returns (the module docstring says what)."""
    if kwargs:
        raise TypeError(
            f"with_structured_output got unknown keyword argument(s) {sorted(kwargs)}; "
            "accepted: schema, method, include_raw, strict"
        )
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, not {method!r}")
    if schema is None and method != "json_mode":
        raise ValueError(f"method={method!r} needs a schema (method='json_mode' takes none)")
    ls_format = {
        "kwargs": {"method": method},
        "schema": convert_to_json_schema(schema) if schema is not None else None,
    }
    if method == "function_calling":
        from .tools import tool_specs

        name = tool_specs([schema])[0]["function"]["name"]
        llm = model.bind_tools(
            [schema], tool_choice=name, ls_structured_output_format=ls_format
        )
        parser: Runnable = ToolArgsParser(schema_=schema)
    else:
        fmt = response_format(schema)
        llm = model.bind(response_format=fmt, ls_structured_output_format=ls_format)
        parser = StructuredParser(schema_=schema)
    if not include_raw:
        return llm | parser
    parser_assign = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    )
    parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
    with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
    return RunnableMap(raw=llm) | with_fallback


def checked_response_format(fmt: Any) -> dict[str, Any]:
    """A call's ``response_format`` (OpenAI's: ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"schema": ...}}``; also a pydantic class, a TypedDict or a
    JSON-schema dict, as ChatOpenAI takes) as the engine's constraint spec.

    Raises:
        ValueError: a dict of neither shape.
    """
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema", "regex", "grammar"):
        if fmt["type"] == "json_schema" and not isinstance(fmt.get("json_schema"), dict):
            raise ValueError(
                "response_format={'type': 'json_schema'} needs 'json_schema': {'name': ..., "
                "'schema': {...}}"
            )
        return fmt
    if isinstance(fmt, dict) and "type" in fmt and "properties" not in fmt:
        raise ValueError(
            f"response_format type must be 'json_object' or 'json_schema', not {fmt['type']!r}"
        )
    return response_format(fmt)
