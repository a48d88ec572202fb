"""Issue 57 on the server without a model: the request a core call with sampling, logprobs,
a constraint or tools becomes (remote client), the server reading it back into the same
settings, and the stream's hold-back of text that may start a tool call.

Against a real server and the packaged model: ``tests/integration/test_serve_sampling.py``."""

from __future__ import annotations

import json

import pytest
from _helpers import require

require("openai")

from tokrag_integrations.server import Limits, parse_chat_request  # noqa: E402
from tokrag_integrations.server.remote_wire import request_body  # noqa: E402
from tokrag_integrations.server.streaming import _Held  # noqa: E402

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _read_back(body):
    """The body as the server receives it (``extra_body`` merged at the top level)."""
    wire = {k: v for k, v in body.items() if k != "extra_body"} | body["extra_body"]
    return parse_chat_request(json.loads(json.dumps(wire)), Limits(), ["tokrag", "rag"])


def test_sampling_and_logprobs_travel_and_read_back():
    body = request_body("Q?", ["d"], {"temperature": 0.7, "top_p": 0.9, "top_k": 40,
                                      "seed": 11, "top_logprobs": 3, "max_new_tokens": 5})
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.7, 0.9, 11)
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    assert body["extra_body"]["top_k"] == 40  # vLLM's extension rides in the body
    req = _read_back(body)
    assert req.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 11}
    assert (req.logprobs, req.top_logprobs, req.n) == (True, 3, 1)


def test_greedy_calls_send_no_sampling_fields():
    body = request_body("Q?", None, {"temperature": None, "seed": None, "top_logprobs": 0})
    assert not {"temperature", "top_p", "seed", "logprobs", "top_logprobs"} & set(body)
    assert _read_back(body).sampling == {}


@pytest.mark.parametrize(
    ("spec", "where"),
    [
        ({"type": "json_object"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "object"}}},
         "response_format"),
        ({"type": "regex", "regex": "[0-9]+"}, "tokrag"),
        ({"type": "grammar", "grammar": 'start: "yes" | "no"'}, "tokrag"),
    ],
)
def test_a_constraint_spec_travels_in_its_field_and_reads_back(spec, where):
    body = request_body("Q?", None, {"constraint": spec})
    sent = body["response_format"] if where == "response_format" else body["extra_body"]["tokrag"]["constraint"]
    assert sent == spec
    assert _read_back(body).constraint == spec


def test_a_compiled_constraint_cannot_travel():
    class Compiled:
        def fill_bitmask(self, bitmask, index):  # the TokenConstraint protocol's shape
            pass

    with pytest.raises(TypeError, match="spec dict .* got Compiled; the server compiles it"):
        request_body("Q?", None, {"constraint": Compiled()})
    with pytest.raises(TypeError, match="spec dict"):
        request_body("Q?", None, {"constraint": {"type": "xml"}})


def test_tools_tool_choice_and_tool_turns_travel_in_openais_shape():
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        # a chat template's shape (arguments an object) and the parsed shape
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Oslo"}}},
            {"id": "c2", "name": "get_weather", "arguments": {"city": "Bergen"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "7 C"},
    ]
    body = request_body(None, None, {"messages": history, "tools": [TOOL],
                                     "tool_choice": "get_weather"})
    assert body["messages"][-1] == {"role": "tool", "tool_call_id": "c2", "content": "7 C"}
    calls = body["messages"][1]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}, {"city": "Bergen"}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    req = _read_back(body)
    assert req.tools == [TOOL] and req.tool_choice == "get_weather" and req.calls_tools
    # kept whole for the service to render, each tool result named after its call
    assert [t.get("name") for t in req.conversation if t["role"] == "tool"] == ["get_weather"] * 2
    assert req.conversation[1]["tool_calls"][1]["function"]["arguments"] == {"city": "Bergen"}
    assert request_body("Q?", None, {"tools": [TOOL], "tool_choice": "any"})["tool_choice"] == "required"


def test_parallel_tool_calls_travel_as_the_local_call_has_it():
    """The remote clients send ``parallel_tool_calls`` so that a served call ends where the
    local one does (LangChain's default: one call; LlamaIndex's and OpenAI's: several)."""
    one = request_body("Q?", None, {"tools": [TOOL], "parallel_tool_calls": False})
    assert one["parallel_tool_calls"] is False and not _read_back(one).parallel_tool_calls
    many = request_body("Q?", None, {"tools": [TOOL], "parallel_tool_calls": True})
    assert many["parallel_tool_calls"] is True and _read_back(many).parallel_tool_calls
    assert "parallel_tool_calls" not in request_body("Q?", None, {"tools": [TOOL]})


def test_a_conversation_without_tools_is_split_at_once():
    req = _read_back(request_body("Q?", None, {"system_prompt": "Be brief."}))
    assert req.conversation is None and (req.query, req.system_prompt) == ("Q?", "Be brief.")


def _shown(held, pieces):
    return [held.add(p) for p in pieces]


def test_the_stream_holds_back_what_may_start_a_tool_call():
    held = _Held(hold_all=False, tools=True)
    shown = _shown(held, ["Let me ", "check. <", "tool", "_call>", '{"name": "f"}', "</tool_call>"])
    assert shown == ["Let me ", "check. ", "", "", "", ""]
    assert held.text[held.shown:].startswith("<tool_call>")
    # a '<' that turns out not to start a call is shown once it cannot
    held = _Held(hold_all=False, tools=True)
    assert _shown(held, ["a <", "b"]) == ["a ", "<b"]


def test_the_stream_shows_everything_without_tools_and_nothing_under_required():
    assert _shown(_Held(hold_all=False, tools=False), ["<tool", "_call>"]) == ["<tool", "_call>"]
    assert _shown(_Held(hold_all=True, tools=True), ["x", "y"]) == ["", ""]
