"""Structured output and tool calls by constrained decoding (docs/structured.md).

A spec (a JSON schema, a regex, a grammar) or a set of tools is compiled by llguidance into a
:class:`GrammarConstraint`: the engine asks it for the tokens allowed next, masks every context
of the query with them, and tells it the token chosen. Needs the ``structured`` extra
(``pip install 'tokrag-integrations[structured]'``); importing this package does not import
llguidance, the first constraint does.

* :func:`constraint_for` (``generate(..., constraint=spec)`` calls it);
* :func:`json_schema_of`, :func:`response_format_of`, :func:`parse_structured`;
* :func:`tool_spec`, :func:`render_tools`, :func:`tool_call_constraint`,
  :func:`parse_tool_calls`, :func:`tool_result_message`.
"""

from .grammar import SPEC_TYPES, GrammarConstraint, constraint_for
from .json_schemas import json_schema_of, parse_structured, response_format_of
from .tool_calls import find_tool_calls, new_call_id, parse_tool_calls, tool_result_message
from .tool_messages import render_tools, template_tools_text, text_messages
from .tool_specs import choice_of, tool_call_constraint, tool_spec, tool_specs

__all__ = [
    "SPEC_TYPES",
    "GrammarConstraint",
    "choice_of",
    "constraint_for",
    "find_tool_calls",
    "json_schema_of",
    "new_call_id",
    "parse_structured",
    "parse_tool_calls",
    "render_tools",
    "response_format_of",
    "template_tools_text",
    "text_messages",
    "tool_call_constraint",
    "tool_result_message",
    "tool_spec",
    "tool_specs",
]
