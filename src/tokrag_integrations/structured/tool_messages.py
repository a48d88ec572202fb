"""A conversation with tools, as the plain chat turns the prompt builder takes.

The engine's prompts are ``system`` / ``user`` / ``assistant`` turns of text
(:func:`tokrag_integrations.prompts.check_messages`), so :func:`render_tools` turns what a tool
conversation adds into text in those turns, the Hermes / Qwen2.5 way:

* the tools' descriptions: where the model's own chat template puts them when it renders
  ``apply_chat_template(tools=...)`` (found by rendering with and without the tools, and used
  only when the difference is text inside one turn, checked by rendering it back); else one
  system block (:data:`FALLBACK_INTRO`) that lists them and says how to call;
* an assistant turn's ``tool_calls``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  after its content;
* ``role: "tool"`` results: one user turn per run of results, each in
  ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .tool_specs import CALL_CLOSE, CALL_OPEN, tool_specs

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
#: The start of the fallback tools block (for a template that does not render tools).
FALLBACK_INTRO = "You can call tools to help answer. The tools, one JSON object per line:"

# Probe contents: strings no template writes itself.
_PROBE = {"system": "\u2063SYSTEM-PROBE\u2063", "first": "\u2063USER-ONE\u2063",
          "assistant": "\u2063ASSISTANT\u2063", "last": "\u2063USER-TWO\u2063"}


def _text(content: Any, where: str) -> str:
    """A turn's content as text: a string, None (empty) or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where} has a content part of type {kind!r}; only text parts are read")
        return "".join(parts)
    raise ValueError(f"{where} needs string content, got {type(content).__name__}")


def _call_text(call: Any, where: str) -> str:
    """One call as the model writes it. Reads OpenAI's ``{"function": {"name", "arguments":
    str}}``, LangChain's ``{"name", "args"}`` and :func:`.tool_calls.parse_tool_calls`' shape."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(call).__name__}")
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = fn.get("name")
    arguments = fn.get("arguments", fn.get("args", {}))
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} has no tool name")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} ({name}) has arguments that are not JSON: {exc.msg}") from None
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def text_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``messages`` (OpenAI chat messages, tool calls and results included) as system / user /
    assistant turns of text; ValueError naming a turn it cannot read."""
    out: list[dict[str, str]] = []
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for i, m in enumerate(messages or []):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role == "tool":
            results.append(f"{RESPONSE_OPEN}\n{_text(m.get('content'), f'messages[{i}]')}\n{RESPONSE_CLOSE}")
            continue
        flush()
        if role not in ("system", "user", "assistant"):
            raise ValueError(
                f"messages[{i}] has role {role!r}; use 'system', 'user', 'assistant' or 'tool'"
            )
        content = _text(m.get("content"), f"messages[{i}]")
        calls = m.get("tool_calls") or []
        if calls and role != "assistant":
            raise ValueError(f"messages[{i}] ({role}) has tool_calls; only assistant turns make calls")
        written = [_call_text(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        content = "\n".join(([content] if content else []) + written)
        out.append({"role": role, "content": content})
    flush()
    return out


def fallback_block(specs: Sequence[Mapping[str, Any]]) -> str:
    """The system text that offers ``specs`` to a model whose template does not render tools."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return (
        f"{FALLBACK_INTRO}\n<tools>\n{lines}\n</tools>\n"
        f'To call a tool, answer with {CALL_OPEN}{{"name": <the tool\'s name>, "arguments": '
        f"<its arguments as a JSON object>}}{CALL_CLOSE}. A tool's result comes back in "
        f"{RESPONSE_OPEN}{RESPONSE_CLOSE}; answer the question with it."
    )


def _render(tokenizer: Any, messages: list[dict[str, str]], **options: Any) -> str | None:
    from ..prompts import render_chat_template

    try:
        return render_chat_template(tokenizer, messages, tokenize=False, add_generation_prompt=True, **options)
    except Exception:  # a template that cannot take tools (or these probes): not native
        return None


def template_tools_text(tokenizer: Any, specs: Sequence[Mapping[str, Any]]) -> tuple[str, str, str] | None:
    """Where and what the chat template writes for ``specs``: ``(turn, "append" | "prepend",
    text)`` with ``turn`` one of ``"system"``, ``"first"`` / ``"last"`` (user turn); None when
    the template ignores ``tools=`` or writes them other than as text inside one turn."""
    if not getattr(tokenizer, "chat_template", None) or not specs:
        return None
    probe = [{"role": "system", "content": _PROBE["system"]}, {"role": "user", "content": _PROBE["first"]},
             {"role": "assistant", "content": _PROBE["assistant"]}, {"role": "user", "content": _PROBE["last"]}]
    plain = _render(tokenizer, probe)
    with_tools = _render(tokenizer, probe, tools=[dict(s) for s in specs])
    if plain is None or with_tools is None or plain == with_tools:
        return None
    start = 0
    while start < min(len(plain), len(with_tools)) and plain[start] == with_tools[start]:
        start += 1
    tail = 0
    while tail < min(len(plain), len(with_tools)) - start and plain[-1 - tail] == with_tools[-1 - tail]:
        tail += 1
    if plain[start : len(plain) - tail]:  # the template changed text, not only added some
        return None
    inserted = with_tools[start : len(with_tools) - tail]
    for turn, sentinel in _PROBE.items():
        if turn == "assistant":
            continue
        if plain[:start].endswith(sentinel):
            where = (turn, "append", inserted)
        elif plain[start:].startswith(sentinel):
            where = (turn, "prepend", inserted)
        else:
            continue
        if _render(tokenizer, _place(probe, where)) == with_tools:  # the same prompt, as text
            return where
        return None
    return None


def _place(messages: list[dict[str, str]], where: tuple[str, str, str]) -> list[dict[str, str]]:
    """``messages`` with the tools text of :func:`template_tools_text` in its turn."""
    turn, how, text = where
    out = [dict(m) for m in messages]
    if turn == "system":
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": ""})
        index = 0
    else:
        users = [i for i, m in enumerate(out) if m["role"] == "user"]
        if not users:
            out.append({"role": "user", "content": ""})
            users = [len(out) - 1]
        index = users[0] if turn == "first" else users[-1]
    m = out[index]
    m["content"] = m["content"] + text if how == "append" else text + m["content"]
    return out


def render_tools(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any]) -> list[dict[str, str]]:
    """``messages`` with ``tools`` offered, as system / user / assistant turns of text (see the
    module docstring): the template's own tools text where it renders them, else
    :func:`fallback_block` at the end of the system turn (one is added first when there is
    none). Tool calls of assistant turns and ``role: "tool"`` results become text too."""
    turns = text_messages(messages)
    specs = tool_specs(tools) if tools else []
    if not specs:
        return turns
    where = template_tools_text(tokenizer, specs)
    if where is not None:
        return _place(turns, where)
    block = fallback_block(specs)
    if turns and turns[0]["role"] == "system":
        system = turns[0]["content"]
        return [{"role": "system", "content": f"{system}\n\n{block}" if system else block}, *turns[1:]]
    return [{"role": "system", "content": block}, *turns]
