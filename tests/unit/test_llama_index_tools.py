"""TokRAGLLM's tool-calling translation on hand-made messages and responses, without a model
(the packaged model: tests/integration/test_llama_index_chat.py)."""

from __future__ import annotations

import pytest
from _helpers import require

require("llama_index.core", "llama-index-core")

from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.tools import FunctionTool  # noqa: E402

from tokrag_integrations.llama_index import function_calling as fc  # noqa: E402


def search_docs(query: str) -> str:
    """Search the documents."""
    return query


TOOL = FunctionTool.from_defaults(fn=search_docs)


def _call(call_id="call_1", **kwargs):
    return ChatMessage(
        role="assistant",
        blocks=[ToolCallBlock(tool_call_id=call_id, tool_name="search_docs", tool_kwargs=kwargs)],
    )


def test_prepare_offers_the_tools_and_resolves_the_choice():
    history = [ChatMessage(role="system", content="Be brief.")]
    out = fc.prepare([TOOL], "Who?", history, tool_required=True, tool_choice=None, kwargs={})
    assert [m.content for m in out["messages"]] == ["Be brief.", "Who?"]
    assert len(history) == 1  # the caller's history is not extended
    (spec,) = out["tools"]
    assert spec["function"]["name"] == "search_docs"
    assert spec["function"]["parameters"]["required"] == ["query"]
    assert out["tool_choice"] == "required"
    auto = fc.prepare([TOOL], "Who?", None, tool_required=False, tool_choice=None, kwargs={})
    assert auto["tool_choice"] == "auto"
    named = {"type": "function", "function": {"name": "search_docs"}}
    assert fc.prepare([TOOL], "Who?", None, False, named, {})["tool_choice"] == "search_docs"
    with pytest.raises(ValueError, match="unknown tool 'nope'.*'search_docs'"):
        fc.prepare([TOOL], "Who?", None, False, "nope", {})


def test_messages_with_calls_and_results_in_openai_shape():
    messages = [
        ChatMessage(role="user", content="Who founded it?"),
        _call(query="founder"),
        ChatMessage(role="tool", content="Ottoline Varga.", additional_kwargs={"tool_call_id": "call_1"}),
    ]
    user, assistant, tool = fc.openai_messages(messages)
    assert user == {"role": "user", "content": "Who founded it?"}
    assert assistant["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "search_docs", "arguments": {"query": "founder"}}}
    ]
    assert tool == {"role": "tool", "tool_call_id": "call_1", "name": "search_docs", "content": "Ottoline Varga."}
    assert fc.tool_rounds(messages) == 1
    assert fc.tool_rounds(messages[:1]) == 0
    # OpenAI-shaped calls in additional_kwargs are read too (arguments as a JSON string).
    openai = ChatMessage(
        role="assistant",
        content="",
        additional_kwargs={"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
    )
    assert fc.openai_messages([openai])[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_an_answer_is_parsed_into_tool_call_blocks_and_selections():
    text = 'Let me look.<tool_call>\n{"name": "search_docs", "arguments": {"query": "founder"}}\n</tool_call>'
    r = fc.chat_response(CompletionResponse(text=text), [{"function": {"name": "search_docs"}}])
    text_block, call_block = r.message.blocks
    assert isinstance(text_block, TextBlock) and text_block.text == "Let me look."
    assert call_block.tool_name == "search_docs" and call_block.tool_kwargs == {"query": "founder"}
    (sel,) = fc.tool_selections(r, error_on_no_tool_call=True)
    assert (sel.tool_id, sel.tool_name, sel.tool_kwargs) == (call_block.tool_call_id, "search_docs", {"query": "founder"})
    assert r.message.additional_kwargs["tool_calls"][0]["function"]["arguments"] == '{"query": "founder"}'
    # Without tools offered the text stays text; no call is an error only when asked.
    plain = fc.chat_response(CompletionResponse(text=text), None)
    assert plain.message.content == text and fc.tool_selections(plain, False) == []
    with pytest.raises(ValueError, match="tool_required=True"):
        fc.tool_selections(plain, True)


def test_only_the_first_call_is_kept_without_parallel_calls():
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    r = fc.chat_response(CompletionResponse(text=two), [{}])
    assert [s.tool_name for s in fc.tool_selections(r, True)] == ["a", "b"]
    fc.keep_first_call(r)
    assert [s.tool_name for s in fc.tool_selections(r, True)] == ["a"]
    assert len(r.message.additional_kwargs["tool_calls"]) == 1


def test_a_streamed_answer_shows_text_but_not_the_call():
    pieces = ["It is ", "<tool", '_call>{"name": "search_docs", ', '"arguments": {}}</tool_call>']
    chunks, text = [], ""
    for p in pieces:
        text += p
        chunks.append(CompletionResponse(text=text, delta=p))
    chunks.append(CompletionResponse(text=text, delta=""))  # the stream's last response
    out = list(fc.chat_stream(iter(chunks), [{}]))
    assert "".join(r.delta for r in out) == "It is "
    assert all("<tool" not in (r.message.content or "") for r in out[:-1])
    assert [s.tool_name for s in fc.tool_selections(out[-1], True)] == ["search_docs"]
    # Without tools every delta is shown.
    shown = list(fc.chat_stream(iter(chunks), None))
    assert "".join(r.delta for r in shown) == text


def test_visible_text_holds_back_a_possible_call_start():
    assert fc._visible("answer <to") == "answer "
    assert fc._visible("answer <b>") == "answer <b>"
    assert fc._visible("x<tool_call>{") == "x"


def test_a_server_gets_the_turns_tools_and_choice_as_openai_shapes():
    spec = fc.specs_of([TOOL])
    messages = [ChatMessage(role="user", content="Who founded it?")]
    query, kw = fc.tool_turn(object(), messages, spec, "required", {"policy": "no_rag"}, policy="tokrag", passages=None)
    assert query == "Who founded it?"
    assert kw == {"policy": "no_rag", "messages": [], "tools": spec, "tool_choice": "required",
                  "parallel_tool_calls": True}  # LlamaIndex's default: several calls an answer
    one = fc.tool_turn(object(), messages, spec, "required", {}, policy="tokrag", passages=None,
                       parallel=False)[1]
    assert one["parallel_tool_calls"] is False
    answered = [
        *messages,
        _call(query="founder"),
        ChatMessage(role="tool", content="Ottoline Varga.", additional_kwargs={"tool_call_id": "call_1"}),
    ]
    query, kw = fc.tool_turn(object(), answered, spec, "auto", {"policy": "no_rag"}, policy="tokrag", passages=None)
    assert query is None and kw["policy"] == "tokrag"  # the results end the turns
    assert [t["role"] for t in kw["messages"]] == ["user", "assistant", "tool"]


def test_sampling_values_are_checked_before_a_model_loads():
    from tokrag_integrations.llama_index import TokRAGLLM

    with pytest.raises(ValueError, match="top_p"):
        TokRAGLLM(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        TokRAGLLM(temperature=-0.5)


def test_a_chat_response_keeps_the_logprobs():
    from llama_index.core.base.llms.types import LogProb

    lp = [[LogProb(token="a", logprob=-0.1, bytes=[97])]]
    r = fc.chat_response(CompletionResponse(text="a", logprobs=lp), None)
    assert isinstance(r, ChatResponse) and r.logprobs == lp
