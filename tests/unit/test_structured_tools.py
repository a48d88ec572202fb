"""Tools of ``tokrag_integrations.structured``: specs from every kind of tool, the call grammar
stepped on SmolLM2's tokenizer, parsing calls back, and the conversation as text turns."""

from __future__ import annotations

import copy
import json

import pytest

pytest.importorskip("llguidance")

from _structured import TokenizerOnly, ids_of, packaged_tokenizer, walk  # noqa: E402

from tokrag_integrations.structured import (  # noqa: E402
    choice_of,
    find_tool_calls,
    parse_tool_calls,
    render_tools,
    template_tools_text,
    text_messages,
    tool_call_constraint,
    tool_result_message,
    tool_spec,
    tool_specs,
)

ADD_PARAMETERS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "description": "the first number"},
        "b": {"type": "integer", "description": "the second number"},
    },
    "required": ["a", "b"],
}


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return packaged_tokenizer()


@pytest.fixture
def lm(smollm2_tokenizer):  # replaces the refused session model: a tokenizer, no weights
    return TokenizerOnly(smollm2_tokenizer)


def parameters(spec):
    return spec["function"]["parameters"]


def test_tool_spec_of_a_python_function():
    spec = tool_spec(add)
    assert spec["type"] == "function"
    assert spec["function"]["name"] == "add"
    assert spec["function"]["description"] == "Add two numbers."
    assert parameters(spec) == ADD_PARAMETERS


def test_tool_spec_of_a_pydantic_class():
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """The weather in a city."""

        city: str = Field(description="the city")
        unit: str = "celsius"

    spec = tool_spec(GetWeather)
    assert spec["function"]["name"] == "GetWeather"
    assert spec["function"]["description"] == "The weather in a city."
    assert parameters(spec)["required"] == ["city"]
    assert parameters(spec)["properties"]["city"] == {"description": "the city", "type": "string"}


def test_tool_spec_of_a_langchain_tool():
    from langchain_core.tools import tool

    @tool
    def search(query: str, k: int = 3) -> str:
        """Search the documents."""
        return query

    spec = tool_spec(search)
    assert spec["function"]["name"] == "search"
    assert spec["function"]["description"] == "Search the documents."
    assert parameters(spec)["properties"] == {"query": {"type": "string"}, "k": {"default": 3, "type": "integer"}}
    assert parameters(spec)["required"] == ["query"]


def test_tool_spec_of_a_llama_index_tool_and_its_metadata():
    from llama_index.core.tools import FunctionTool

    function_tool = FunctionTool.from_defaults(fn=add)
    for tool in (function_tool, function_tool.metadata):
        spec = tool_spec(tool)
        assert spec["function"]["name"] == "add"
        assert "Add two numbers." in spec["function"]["description"]
        assert parameters(spec)["required"] == ["a", "b"]
        assert set(parameters(spec)["properties"]) == {"a", "b"}


def test_tool_spec_of_openai_dicts_and_bad_tools():
    full = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": ADD_PARAMETERS}}
    assert tool_spec(full) == full
    assert tool_spec(full["function"]) == full
    with pytest.raises(ValueError, match="tool name 'bad name' must be"):
        tool_spec({"name": "bad name", "parameters": ADD_PARAMETERS})
    with pytest.raises(ValueError, match="must be an object schema"):
        tool_spec({"name": "f", "parameters": {"type": "string"}})
    with pytest.raises(TypeError, match="a tool must be an OpenAI tool dict"):
        tool_spec(42)
    with pytest.raises(ValueError, match="two tools share the name 'add'"):
        tool_specs([add, full])


def test_choice_of_reads_every_form_and_names_an_unknown_tool():
    specs = tool_specs([add])
    assert choice_of(None, specs) == "auto"
    assert choice_of("any", specs) == choice_of(True, specs) == "required"
    assert choice_of({"type": "function", "function": {"name": "add"}}, specs) == "add"
    assert choice_of("add", specs) == "add"
    with pytest.raises(ValueError, match="tool_choice names an unknown tool 'mul'; the tools are 'add'"):
        choice_of("mul", specs)
    with pytest.raises(ValueError, match="needs at least one tool"):
        choice_of("required", [])


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_required_choice_forces_a_call_matching_the_schema(lm):
    c = tool_call_constraint([add, tool_spec({"name": "now", "parameters": {}})], "required", lm)
    assert not c.allowed(ids_of(lm, "Hello")[0]) and not c.allowed(lm.eos_token_ids[0])
    walk(c, lm, '<tool_call>{"name": "')
    assert not c.allowed(ids_of(lm, "mul")[0])  # only the tools' names
    walk(c, lm, 'add", "arguments": {"a": 2, "b": ')
    assert not c.allowed(ids_of(lm, '"')[0])  # b is an integer
    walk(c, lm, "3}}</tool_call>")
    assert c.is_finished()  # one call ends the answer
    parallel = tool_call_constraint([add], "required", lm, parallel=True)
    walk(parallel, lm, CALL)
    assert not parallel.is_finished() and parallel.allowed(lm.eos_token_ids[0])  # another may follow
    walk(parallel, lm, "\n" + CALL)
    assert parallel.allowed(lm.eos_token_ids[0])


def test_named_choice_allows_that_tool_only(lm):
    now = {"name": "now", "parameters": {"type": "object", "properties": {}}}
    c = tool_call_constraint([add, now], "now", lm)
    walk(c, lm, '<tool_call>{"name": "')
    assert not c.allowed(ids_of(lm, "add")[0])
    walk(c, lm, 'now", "arguments": {}}</tool_call>')
    assert tool_call_constraint([add], "none", lm) is None


def test_auto_choice_is_free_text_until_a_call_starts(lm):
    c = tool_call_constraint([add], "auto", lm)
    assert c.allowed(lm.eos_token_ids[0])  # an empty answer is an answer
    walk(c, lm, "Let me add them: {not json} <tool")
    walk(c, lm, "_call>")
    assert not c.allowed(ids_of(lm, "hello")[0])  # the marker opened a call: JSON now
    walk(c, lm, '{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    assert c.is_finished()  # the call ends the answer
    parallel = tool_call_constraint([add], "auto", lm, parallel=True)
    walk(parallel, lm, "Adding. " + CALL + " Done. " + CALL)
    assert parallel.allowed(lm.eos_token_ids[0]) and not parallel.is_finished()
    with pytest.raises(ValueError, match=r"not allowed here by the text or tool calls \(add\)"):
        fresh = c.fork()
        walk(fresh, lm, "<tool_call>")
        fresh.accept(ids_of(lm, "hello")[0])


def test_parse_tool_calls_well_formed_multiple_and_malformed():
    content, calls = parse_tool_calls("Sure.\n" + CALL + "\n" + CALL.replace('"a": 2', '"a": 7'))
    assert content == "Sure."
    assert [c["name"] for c in calls] == ["add", "add"]
    assert [c["arguments"] for c in calls] == [{"a": 2, "b": 3}, {"a": 7, "b": 3}]
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]

    # arguments written as a JSON string, Llama's "parameters", and an unclosed last call
    text = ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
            '<tool_call>\n{"name": "add", "parameters": {"a": 4, "b": 5}}')
    assert [c["arguments"] for c in parse_tool_calls(text)[1]] == [{"a": 1, "b": 1}, {"a": 4, "b": 5}]

    broken = 'Hmm <tool_call>{"name": "add", "arguments": {"a": 2</tool_call> ok ' + CALL
    content, calls, invalid = find_tool_calls(broken)
    assert [c["arguments"] for c in calls] == [{"a": 2, "b": 3}]
    assert len(invalid) == 1 and invalid[0]["name"] == "add"
    assert invalid[0]["error"].startswith("the call is not JSON")
    assert '{"name": "add", "arguments": {"a": 2</tool_call>' in content  # nothing lost
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    assert find_tool_calls('<tool_call>["add"]</tool_call>')[2][0]["error"] == "the call is a JSON list, not an object"
    assert find_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[2][0]["error"] == 'the call has no "name" string'


def test_text_messages_write_calls_and_results_as_turns():
    messages = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        tool_result_message("c1", 5, name="add"),
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "more"}]},
    ]
    turns = text_messages(messages)
    assert turns == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n5\n</tool_response>\n<tool_response>\nmore\n</tool_response>"},
    ]
    # the written call is what parse_tool_calls reads back
    assert parse_tool_calls(turns[1]["content"])[1][0]["arguments"] == {"a": 2, "b": 3}
    # LangChain's {"name", "args"} calls too
    lc = text_messages([{"role": "assistant", "content": "ok", "tool_calls": [{"name": "add", "args": {"a": 1, "b": 2}, "id": "x"}]}])
    assert lc[0]["content"].startswith("ok\n<tool_call>\n")
    with pytest.raises(ValueError, match=r"messages\[0\] has role 'function'"):
        text_messages([{"role": "function", "content": "x"}])
    with pytest.raises(ValueError, match=r"tool_calls\[0\] \(add\) has arguments that are not JSON"):
        text_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{a"}}]}])


def test_render_tools_falls_back_to_a_system_block_for_smollm2(smollm2_tokenizer):
    assert template_tools_text(smollm2_tokenizer, tool_specs([add])) is None  # its template ignores tools=
    out = render_tools(smollm2_tokenizer, [{"role": "user", "content": "2+3?"}], [add])
    assert [m["role"] for m in out] == ["system", "user"]
    assert '"name": "add"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    kept = render_tools(smollm2_tokenizer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q"}], [add])
    assert kept[0]["content"].startswith("Be brief.\n\n") and len(kept) == 2
    assert render_tools(smollm2_tokenizer, [{"role": "user", "content": "q"}], []) == [{"role": "user", "content": "q"}]


TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.role == 'system' and tools %}\n\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_render_tools_uses_the_templates_own_tools_text(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = TOOLS_TEMPLATE
    specs = tool_specs([add])
    where = template_tools_text(tokenizer, specs)
    assert where is not None and where[:2] == ("system", "append")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    out = render_tools(tokenizer, messages, [add])
    native = tokenizer.apply_chat_template(messages, tools=specs, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(out, tokenize=False, add_generation_prompt=True) == native
    # transformers renders with trim_blocks: the newline after the if tag goes
    assert out[0]["content"].startswith("Be brief.\n# Tools\n" + json.dumps(specs[0])[:30])
