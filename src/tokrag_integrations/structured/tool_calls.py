"""Tool calls read back from generated text, and tool results as chat messages."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .tool_specs import CALL_CLOSE, CALL_OPEN

# A call block: "<tool_call>" ... "</tool_call>", or "<tool_call>" ... to the end of the text (a
# decode stopped by max_new_tokens or EOS before the closing tag).
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _read_call(body: str) -> tuple[dict[str, Any] | None, str]:
    """``(call, "")`` of one block's body, or ``(None, why)``."""
    body = body.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"the call is not JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(value, dict):
        return None, f"the call is a JSON {type(value).__name__}, not an object"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, 'the call has no "name" string'
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f"the arguments of {name!r} are a string that is not JSON"
    if not isinstance(arguments, dict):
        return None, f"the arguments of {name!r} are a JSON {type(arguments).__name__}, not an object"
    return {"id": new_call_id(), "name": name, "arguments": arguments}, ""


def find_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """``(content, calls, invalid)`` of generated text.

    ``content``: the text outside well-formed call blocks (stripped); ``calls``: ``{"id",
    "name", "arguments": dict}`` for each well-formed block, in order; ``invalid``: ``{"id",
    "name" (None when unreadable), "args" (the block's text), "error" (why)}`` for each block
    that is not a call (LangChain's ``invalid_tool_calls``). A malformed block stays in
    ``content`` too, so no text is lost.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls takes the generated text (a str), got {type(text).__name__}")
    calls: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    kept: list[str] = []
    end = 0
    for match in _BLOCK.finditer(text):
        call, why = _read_call(match.group(1))
        kept.append(text[end : match.start()])
        if call is None:
            name = re.search(r'"name"\s*:\s*"([^"]*)"', match.group(1))
            invalid.append({
                "id": new_call_id(), "name": name.group(1) if name else None,
                "args": match.group(1).strip(), "error": why,
            })
            kept.append(match.group(0))
        else:
            calls.append(call)
        end = match.end()
    kept.append(text[end:])
    return "".join(kept).strip(), calls, invalid


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, calls)`` of generated text: the text outside the call blocks, and
    ``{"id", "name", "arguments": dict}`` for each well-formed ``<tool_call>{...}</tool_call>``
    (see :func:`find_tool_calls` for the malformed ones)."""
    content, calls, _ = find_tool_calls(text)
    return content, calls


def tool_result_message(tool_call_id: str, content: Any, name: str | None = None) -> dict[str, Any]:
    """The chat message that gives a tool's result back to the model (OpenAI's ``role: "tool"``
    message); a non-string result is written as JSON."""
    if not isinstance(tool_call_id, str) or not tool_call_id:
        raise ValueError("a tool result needs the tool_call_id of the call it answers")
    text = content if isinstance(content, str) else json.dumps(content, default=str)
    message: dict[str, Any] = {"role": "tool", "tool_call_id": tool_call_id, "content": text}
    if name is not None:
        message["name"] = name
    return message
