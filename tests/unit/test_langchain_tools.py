"""ChatTokRAG's tools, structured output and sampling options, without a model: tool_choice,
the streamed text held back from a tool call, tool turns, response formats, option checks
(issue 57). On the real model: ``tests/integration/test_langchain_tools.py``."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from tokrag_integrations.langchain import ChatTokRAG
from tokrag_integrations.langchain.chat_options import sampling_options
from tokrag_integrations.langchain.structured_output import checked_response_format
from tokrag_integrations.langchain.tools import (
    HeldText,
    call_chunks,
    checked_tool_choice,
    has_tool_turns,
    langchain_calls,
    tool_specs,
    tool_turn,
    unsent,
)


@tool
def magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input + 2


class Weather(BaseModel):
    """The weather in a city."""

    city: str


def test_tool_choice_forms_and_unknown_names() -> None:
    specs = tool_specs([magic_function, Weather])
    assert [s["function"]["name"] for s in specs] == ["magic_function", "Weather"]
    assert specs[0]["function"]["parameters"]["properties"]["input"]["type"] == "integer"
    assert checked_tool_choice(None, specs) == "auto"
    assert checked_tool_choice("any", specs) == "required"
    assert checked_tool_choice(True, specs) == "required"
    assert checked_tool_choice(False, specs) == "none"
    assert checked_tool_choice("Weather", specs) == "Weather"
    openai_form = {"type": "function", "function": {"name": "magic_function"}}
    assert checked_tool_choice(openai_form, specs) == "magic_function"
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        checked_tool_choice("nope", specs)
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        ChatTokRAG().bind_tools([magic_function], tool_choice="nope")
    with pytest.raises(TypeError, match="list of tools"):
        tool_specs(magic_function)  # type: ignore[arg-type]
    # The same tool twice is one; two different tools with one name are refused.
    assert len(tool_specs([Weather, Weather.model_json_schema()])) == 1
    other = {"type": "function", "function": {"name": "Weather", "parameters": {}}}
    with pytest.raises(ValueError, match="share the name"):
        tool_specs([Weather, other])


def test_held_text_sends_only_what_no_call_holds() -> None:
    held = HeldText(tools=True)
    sent = [held.push(d) for d in ["Let me ", "check. <", "tool_", "call>{\"name\"", ": 1}"]]
    assert "".join(sent) == "Let me check. " and held.sent == "Let me check. "
    # A "<" that turns out to start no call is sent once the text shows it.
    held = HeldText(tools=True)
    assert [held.push(d) for d in ["a <", "b"]] == ["a ", "<b"]
    plain = HeldText(tools=False)
    assert [plain.push(d) for d in ["<tool_", "call>"]] == ["<tool_", "call>"]
    # The last chunk adds what the answer's content (stripped) has beyond the sent text.
    assert unsent("Let me check.", "Let me check. ") == ""
    assert unsent("ab", "a") == "b" and unsent("", "") == ""


def test_calls_as_tool_calls_and_as_chunks_add_up() -> None:
    calls = [
        {"id": "call_1", "name": "magic_function", "arguments": {"input": 3}},
        {"id": "call_2", "name": "Weather", "arguments": {"city": "Oslo"}},
    ]
    message = AIMessage(content="", tool_calls=langchain_calls(calls))
    chunk = AIMessageChunk(content="", tool_call_chunks=call_chunks(calls))
    merged = AIMessageChunk(content="") + chunk
    assert merged.tool_calls == message.tool_calls
    assert [c["args"] for c in message.tool_calls] == [{"input": 3}, {"city": "Oslo"}]


def test_tool_turns_of_a_conversation() -> None:
    call = {"name": "magic_function", "args": {"input": 3}, "id": "call_1", "type": "tool_call"}
    messages = [
        HumanMessage("What is magic_function(3)?"),
        AIMessage(content="", tool_calls=[call]),
        ToolMessage("5", tool_call_id="call_1", name="magic_function"),
    ]
    assert has_tool_turns(messages) and not has_tool_turns(messages[:1])
    assert tool_turn(messages[0], "x") is None
    assistant = tool_turn(messages[1], "")
    assert assistant is not None and assistant["role"] == "assistant"
    fn = assistant["tool_calls"][0]["function"]
    assert fn["name"] == "magic_function" and json.loads(fn["arguments"]) == {"input": 3}
    assert tool_turn(messages[2], "5") == {
        "role": "tool",
        "tool_call_id": "call_1",
        "name": "magic_function",
        "content": "5",
    }


def test_response_formats() -> None:
    assert checked_response_format({"type": "json_object"}) == {"type": "json_object"}
    spec = checked_response_format(Weather)
    assert spec["type"] == "json_schema"
    assert spec["json_schema"]["schema"]["properties"]["city"]["type"] == "string"
    with pytest.raises(ValueError, match="json_schema"):
        checked_response_format({"type": "json_schema"})
    with pytest.raises(ValueError, match="'xml'"):
        checked_response_format({"type": "xml"})


def test_sampling_options_are_checked_before_any_model_loads() -> None:
    assert sampling_options({}) == {}
    assert sampling_options({"temperature": 0.7, "seed": 3, "logprobs": True}) == {
        "temperature": 0.7,
        "seed": 3,
        "top_logprobs": 0,
    }
    assert sampling_options({"logprobs": True, "top_logprobs": 2})["top_logprobs"] == 2
    with pytest.raises(ValueError, match="needs logprobs=True"):
        sampling_options({"top_logprobs": 2})
    with pytest.raises(ValueError, match="top_p"):
        ChatTokRAG(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        ChatTokRAG(temperature=-1)
    chat = ChatTokRAG(temperature=0.5, top_k=5, seed=1, logprobs=True, top_logprobs=3)
    assert chat._get_ls_params()["ls_temperature"] == 0.5


def test_bad_structured_output_and_tool_arguments() -> None:
    chat = ChatTokRAG()
    with pytest.raises(ValueError, match="method must be one of"):
        chat.with_structured_output(Weather, method="xml")
    with pytest.raises(ValueError, match="needs a schema"):
        chat.with_structured_output(None)
    with pytest.raises(TypeError, match="unknown keyword"):
        chat.with_structured_output(Weather, nonsense=1)
    with pytest.raises(ValueError, match="needs tools"):
        chat.invoke("hi", tool_choice="any")
    with pytest.raises(ValueError, match="cannot both constrain"):
        chat.invoke("hi", tools=[magic_function], response_format={"type": "json_object"})
