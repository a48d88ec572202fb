"""Tools: their specs in OpenAI's function shape, and the grammar of a call to them.

A call is written ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` (the Hermes /
Qwen2.5 convention, which many open chat models are trained on; the fallback system block of
:func:`.tool_messages.render_tools` teaches it to the rest). :func:`tool_call_constraint`
compiles the tools' parameter schemas into one llguidance grammar over that shape:

* ``"required"`` / ``"any"``: a call to one of the tools, nothing else;
* a tool's name: a call to that tool;
* ``"auto"``: free text, in which ``<tool_call>`` opens a call that must then follow the
  schemas. This is llguidance's *lazy lexeme* pattern (its docs/syntax.md, "Tool calling"):
  the free text is a terminal that ends at the first ``<tool_call>``, so the grammar is one
  Earley parse with no trigger machinery of ours (docs/structured.md says why not a second
  constraint switched on by the engine);
* ``"none"``: no constraint (None).

One call ends the answer unless ``parallel=True`` (then calls may follow one another).
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .grammar import GrammarConstraint, bridge_for
from .json_schemas import JSON_OPTIONS, check_schema, closed_schema
from .llguidance_backend import llguidance_module

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: The ``tool_choice`` words (besides a tool's name).
CHOICES = ("auto", "none", "required", "any")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"tool name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (OpenAI's rule)"
        )
    parameters = dict(parameters or {"type": "object", "properties": {}})
    parameters.pop("title", None)
    parameters.pop("description", None)  # the tool's description says it (pydantic copies it here)
    if isinstance(parameters.get("properties"), Mapping):  # pydantic's titles repeat the names
        parameters["properties"] = {
            key: {k: v for k, v in prop.items() if k != "title"} if isinstance(prop, Mapping) else prop
            for key, prop in parameters["properties"].items()
        }
    if parameters.get("type", "object") != "object":
        raise ValueError(f"the parameters of tool {name!r} must be an object schema, got type {parameters.get('type')!r}")
    check_schema(parameters, f"{name}.parameters")
    return {
        "type": "function",
        "function": {"name": name, "description": inspect.cleandoc(description or ""), "parameters": parameters},
    }


def _doc_summary(doc: str | None) -> str:
    """A docstring's description: the text before its ``Args:`` / ``Returns:`` sections."""
    text = inspect.cleandoc(doc or "")
    cut = re.search(r"^\s*(Args|Arguments|Parameters|Returns|Raises|Yields)\s*:?\s*$", text, re.M)
    return (text[: cut.start()] if cut else text).strip()


def _doc_args(doc: str | None) -> dict[str, str]:
    """Parameter descriptions of a Google-style ``Args:`` section."""
    text = inspect.cleandoc(doc or "")
    section = re.search(r"^(Args|Arguments|Parameters)\s*:?\s*\n((?:[ \t]+.*\n?|\s*\n)*)", text, re.M)
    out: dict[str, str] = {}
    if not section:
        return out
    current = None
    for line in section.group(2).splitlines():
        m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if m and (current is None or len(line) - len(line.lstrip()) <= 4):
            current = m.group(1).lstrip("*")
            out[current] = m.group(2).strip()
        elif current and line.strip():
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def _function_parameters(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s parameters (pydantic reads the annotations)."""
    from pydantic import create_model

    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("self", "cls"):
            continue
        annotation = hints.get(p.name, Any)
        fields[p.name] = (annotation, ... if p.default is p.empty else p.default)
    schema = create_model(f"{fn.__name__}_args", **fields).model_json_schema()
    descriptions = _doc_args(fn.__doc__)
    for key, prop in schema.get("properties", {}).items():
        prop.pop("title", None)
        if key in descriptions and "description" not in prop:
            prop["description"] = descriptions[key]
    return schema


def tool_spec(tool: Any) -> dict[str, Any]:
    """``{"type": "function", "function": {"name", "description", "parameters"}}`` of a tool:

    * an OpenAI tool dict (or its bare ``{"name", "description", "parameters"}`` function);
    * a LangChain tool (``BaseTool``, e.g. from ``@tool``): its ``tool_call_schema``;
    * a LlamaIndex tool (``FunctionTool``) or its ``ToolMetadata``: ``to_openai_tool()``;
    * a pydantic model class: the class name, its docstring and its fields;
    * a python function: its name, docstring (Google-style ``Args:`` give the parameters'
      descriptions) and annotated parameters.

    Raises TypeError for anything else, ValueError for a bad name or parameters schema.
    """
    if isinstance(tool, Mapping):
        body = tool.get("function") if tool.get("type") == "function" else tool
        if not isinstance(body, Mapping) or "name" not in body:
            raise ValueError(
                'a tool dict must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        return _function(body["name"], body.get("description", ""), body.get("parameters") or {})
    metadata = getattr(tool, "metadata", None)
    if hasattr(metadata, "to_openai_tool") and not hasattr(tool, "to_openai_tool"):
        tool = metadata  # a LlamaIndex tool: its ToolMetadata
    if hasattr(tool, "to_openai_tool") and hasattr(tool, "fn_schema"):  # LlamaIndex ToolMetadata
        return tool_spec(tool.to_openai_tool())
    if isinstance(getattr(tool, "name", None), str) and hasattr(tool, "tool_call_schema"):  # LangChain
        schema = tool.tool_call_schema
        parameters = schema if isinstance(schema, Mapping) else schema.model_json_schema()
        return _function(tool.name, getattr(tool, "description", "") or "", dict(parameters))
    if isinstance(tool, type) and hasattr(tool, "model_json_schema"):  # a pydantic class
        parameters = tool.model_json_schema()
        description = parameters.pop("description", "") or _doc_summary(tool.__doc__)
        return _function(tool.__name__, description, parameters)
    if inspect.isfunction(tool) or inspect.ismethod(tool):
        return _function(tool.__name__, _doc_summary(tool.__doc__), _function_parameters(tool))
    raise TypeError(
        "a tool must be an OpenAI tool dict, a LangChain tool, a LlamaIndex tool or ToolMetadata, "
        f"a pydantic model class or a python function, got {type(tool).__name__}"
    )


def tool_specs(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """:func:`tool_spec` of each tool; ValueError when two share a name."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        tools = [tools]
    specs = [tool_spec(t) for t in tools]
    names = [s["function"]["name"] for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two tools share the name {dup[0]!r}; tool names must be unique")
    return specs


def choice_of(tool_choice: Any, specs: Sequence[Mapping[str, Any]]) -> str:
    """``tool_choice`` normalised to ``"auto"``, ``"none"``, ``"required"`` or a tool's name.

    Takes OpenAI's forms (the words, ``{"type": "function", "function": {"name": ...}}``),
    LangChain's (``"any"``, ``True``, a bare name) and None (``"auto"``); ValueError naming an
    unknown tool or a value it does not read.
    """
    names = [s["function"]["name"] for s in specs]
    if tool_choice is None:
        return "auto"
    if tool_choice is True:
        tool_choice = "required"
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if not isinstance(name, str):
            raise ValueError(
                'tool_choice must be "auto", "none", "required", a tool name or '
                '{"type": "function", "function": {"name": ...}}'
            )
        tool_choice = name
    elif not isinstance(tool_choice, str):
        raise ValueError(f"tool_choice must be a string or a dict, got {type(tool_choice).__name__}")
    if tool_choice == "any":
        tool_choice = "required"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice != "none" and not names:
            raise ValueError(f"tool_choice {tool_choice!r} needs at least one tool")
        return tool_choice
    if tool_choice not in names:
        known = ", ".join(map(repr, names)) or "none"
        raise ValueError(f"tool_choice names an unknown tool {tool_choice!r}; the tools are {known}")
    return tool_choice


def call_schema(specs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON schema of one call's body: ``{"name": <a tool>, "arguments": <its parameters>}``
    (closed objects, compact whitespace: see :mod:`.json_schemas`)."""
    options = []
    for spec in specs:
        fn = spec["function"]
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": closed_schema(fn["parameters"])},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    body = options[0] if len(options) == 1 else {"anyOf": options}
    return {**body, "x-guidance": dict(JSON_OPTIONS)}


def _marker(bridge: Any, text: str) -> str:
    """``text`` as a Lark item: the special token where the tokenizer has one (Lark's
    ``<token>`` syntax; llguidance matches special tokens by id, not by their text), else the
    string."""
    hf = bridge.hf_tokenizer
    token_id = hf.convert_tokens_to_ids(text)
    if isinstance(token_id, int) and token_id != getattr(hf, "unk_token_id", None) and 0 <= token_id < bridge.vocab_size:
        if bridge.tokenizer.is_special_token(token_id):
            return f"<[{token_id}]>"
    return json.dumps(text)


def call_grammar(
    specs: Sequence[Mapping[str, Any]], choice: str, open_tag: str, close_tag: str, parallel: bool = False
) -> str:
    """The Lark grammar (llguidance's dialect) of the model's output under ``choice``: one
    call, or with ``parallel`` one or more separated by newlines; under ``"auto"`` free text
    first (and, with ``parallel``, between and after the calls)."""
    body = json.dumps(call_schema(specs))
    rules = f'body: %json {body}\n'
    if choice != "auto":
        start = 'start: call ("\\n" call)*\n' if parallel else "start: call\n"
        return f'%llguidance {{}}\n{start}call: {open_tag} "\\n"? body "\\n"? {close_tag}\n{rules}'
    # Free text until the first "<tool_call>" (a lazy terminal ends at its first match), then
    # the call. A special-token marker needs no lazy head: free text cannot contain it.
    if open_tag.startswith("<["):
        head, head_rule = f"TEXT {open_tag}", ""
    else:
        head, head_rule = "head", f"head[lazy]: TEXT {open_tag}\n"
    start = "start: call* TEXT\n" if parallel else "start: TEXT | call\n"
    return (
        f"%llguidance {{}}\n{start}TEXT: /(.|\\n)*/\n{head_rule}"
        f'call: {head} "\\n"? body "\\n"? {close_tag}\n{rules}'
    )


def tool_call_constraint(
    tools: Sequence[Any], tool_choice: Any, lm: Any, *, parallel: bool = False
) -> GrammarConstraint | None:
    """The constraint on the model's output when ``tools`` are offered under ``tool_choice``
    (see the module docstring); None for ``"none"``.

    ``parallel=False`` (the default): at most one call, and the answer ends with it (the
    constraint is finished at ``</tool_call>``): a small model offered "another call?" after
    each one tends to repeat the same call until the token limit. ``parallel=True`` (OpenAI's
    ``parallel_tool_calls``) lets calls follow one another.
    """
    specs = tool_specs(tools)
    choice = choice_of(tool_choice, specs)
    if choice == "none":
        return None
    if choice not in ("auto", "required"):
        specs = [s for s in specs if s["function"]["name"] == choice]
    bridge = bridge_for(lm)
    lark = call_grammar(specs, choice, _marker(bridge, CALL_OPEN), _marker(bridge, CALL_CLOSE), parallel)
    grammar = llguidance_module().LLMatcher.grammar_from_lark(lark)
    names = ", ".join(s["function"]["name"] for s in specs)
    what = "tool calls" if choice == "required" else "text or tool calls" if choice == "auto" else "a call"
    return bridge.constraint(grammar, f"{what} ({names})")
