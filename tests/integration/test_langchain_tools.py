"""ChatTokRAG's chat-model contract on the real packaged model (issue 57): sampling and
log-probabilities, structured output by constrained decoding, tools (a forced call, tool
results fed back, ``create_agent`` with a retriever tool over the sample documents).

The 135M model does not choose tools reliably under ``tool_choice="auto"``; the agent test
forces its first call (``tool_choice`` set by a ``wrap_model_call`` middleware), as
docs/integrations.md says. Answers are short to keep the file cheap on CPU. Cases that need
no model: ``tests/unit/test_langchain_tools.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel
from typing_extensions import TypedDict

from tokrag_integrations.langchain import ChatTokRAG

FACT = "Quillfeather Aerospace was founded in 1994 by Ottoline Varga."
QUESTION = "Which company did Ottoline Varga found, and when?"


@tool
def magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input + 2


class Company(BaseModel):
    """A company."""

    name: str
    founder: str
    year: int


class Sentiment(TypedDict):
    label: Literal["positive", "negative"]
    score: float


PERSON = {
    "title": "Person",
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def chat(lm: Any) -> ChatTokRAG:
    return ChatTokRAG(model=lm, max_tokens=40)


def _merged(stream: Any) -> Any:
    full = None
    for chunk in stream:
        full = chunk if full is None else full + chunk
    return full


# ------------------------------------------------------------------ sampling, logprobs
def test_temperature_zero_is_the_greedy_answer(chat: ChatTokRAG) -> None:
    greedy = chat.invoke(QUESTION, passages=[FACT])
    zero = chat.invoke(QUESTION, passages=[FACT], temperature=0, seed=5)
    assert zero.content == greedy.content
    assert zero.response_metadata["token_ids"] == greedy.response_metadata["token_ids"]


def test_seeded_sampling_is_the_same_alone_batched_and_streamed(lm: Any) -> None:
    chat = ChatTokRAG(model=lm, max_tokens=12, temperature=0.9, top_p=0.95, policy="no_rag")
    q = "Write a short line about the sea."
    alone = chat.invoke(q, seed=11)
    assert chat.invoke(q, seed=11).content == alone.content
    batched = chat.batch([q, q, q], config=None, seed=11)
    assert [m.content for m in batched] == [alone.content] * 3
    streamed = _merged(chat.stream(q, seed=11))
    assert streamed.content == alone.content
    others = {chat.invoke(q, seed=s).content for s in (1, 2, 3, 4)}
    assert len(others | {alone.content}) > 1  # the seed matters
    assert chat._get_ls_params()["ls_temperature"] == 0.9


def test_logprobs_in_invoke_stream_batch_and_async(chat: ChatTokRAG) -> None:
    kw = {"passages": [FACT], "logprobs": True, "top_logprobs": 3, "max_tokens": 8}
    msg = chat.invoke(QUESTION, **kw)
    content = msg.response_metadata["logprobs"]["content"]
    steps = msg.response_metadata["trace"]["steps"]
    assert len(content) == len(steps) == len(msg.response_metadata["token_ids"])
    for entry, step in zip(content, steps, strict=True):
        assert entry["token"] == step["text"] and entry["bytes"] == list(step["text"].encode())
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and entry["logprob"] >= tops[-1] - 1e-6
    # Greedy: the chosen token is the most likely one of the distribution it was taken from.
    assert all(e["token"] == e["top_logprobs"][0]["token"] for e in content)

    def same(other: Any) -> None:
        got = other.response_metadata["logprobs"]["content"]
        assert [e["token"] for e in got] == [e["token"] for e in content]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in content], abs=1e-4)

    same(_merged(chat.stream(QUESTION, **kw)))
    for m in chat.batch([QUESTION, QUESTION], **kw):
        same(m)
    same(asyncio.run(chat.ainvoke(QUESTION, **kw)))
    assert "logprobs" not in chat.invoke(QUESTION, passages=[FACT], max_tokens=2).response_metadata


# ------------------------------------------------------------------ structured output
@pytest.mark.parametrize(
    ("schema", "prompt"),
    [
        (Company, f"{FACT}\nExtract the company."),
        (Sentiment, "Classify the sentiment of: I love this product!"),
        (PERSON, "Alice is 31 years old. Extract the person."),
    ],
    ids=["pydantic", "typeddict", "json_schema"],
)
def test_structured_output_parses(chat: ChatTokRAG, schema: Any, prompt: str) -> None:
    out = chat.with_structured_output(schema).invoke(prompt)
    if schema is Company:
        assert isinstance(out, Company) and out.year == 1994
    else:
        assert isinstance(out, dict)
        keys = set(schema.__annotations__) if schema is Sentiment else set(PERSON["properties"])
        assert set(out) == keys
    streamed = list(chat.with_structured_output(schema).stream(prompt))
    assert streamed == [out]  # one parsed object, at the end


def test_structured_output_under_tokrag_keeps_the_sources(lm: Any) -> None:
    """With passages, the schema's JSON is decoded by Tok-RAG: both contexts under one mask,
    the trace says where each token came from."""
    chat = ChatTokRAG(model=lm, max_tokens=40, passages=[Document(FACT)])
    raw = chat.with_structured_output(Company, include_raw=True).invoke(QUESTION)
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Company)
    meta = raw["raw"].response_metadata
    assert meta["policy"] == "tokrag" and meta["retrieval"]["source"] == "passages"
    assert set(meta["token_sources"]) <= {"agree", "rag", "pure"} and "rag" in meta["counts"]
    assert Company.model_validate_json(raw["raw"].content) == raw["parsed"]
    assert raw["parsed"].founder == "Ottoline Varga"  # the year the 135M model gets wrong


def test_json_mode_and_include_raw_errors(chat: ChatTokRAG) -> None:
    out = chat.with_structured_output(None, method="json_mode").invoke(
        "Return a JSON object with a key 'city' for the capital of France."
    )
    assert isinstance(out, dict)
    short = ChatTokRAG(model=chat.loaded_model, max_tokens=3).with_structured_output(
        Company, include_raw=True
    )
    cut = short.invoke(f"{FACT}\nExtract the company.")
    assert cut["parsed"] is None and "max_tokens" in str(cut["parsing_error"])
    assert cut["raw"].response_metadata["finish_reason"] == "length"


def test_function_calling_method_is_a_forced_call(chat: ChatTokRAG) -> None:
    out = chat.with_structured_output(PERSON, method="function_calling").invoke(
        "Alice is 31 years old. Extract the person."
    )
    assert out == {"name": "Alice", "age": 31}


# ------------------------------------------------------------------ tools
def test_forced_tool_call_invoke_stream_async(chat: ChatTokRAG) -> None:
    bound = chat.bind_tools([magic_function], tool_choice="any")
    q = "What is the value of magic_function(3)? Use the tool."
    msg = bound.invoke(q)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("magic_function", {"input": 3})]
    assert msg.tool_calls[0]["id"].startswith("call_") and msg.content == ""
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    full = _merged(bound.stream(q))
    assert [(c["name"], c["args"]) for c in full.tool_calls] == [("magic_function", {"input": 3})]
    assert full.content == "" and full.tool_call_chunks[0]["args"] == json.dumps({"input": 3})
    got = asyncio.run(bound.ainvoke(q))
    assert [(c["name"], c["args"]) for c in got.tool_calls] == [("magic_function", {"input": 3})]


def test_tool_results_are_fed_back(chat: ChatTokRAG) -> None:
    q = "What is the value of magic_function(3)? Use the tool."
    call = {"name": "magic_function", "args": {"input": 3}, "id": "call_1", "type": "tool_call"}
    messages = [
        HumanMessage(q),
        AIMessage(content="", tool_calls=[call]),
        ToolMessage("5", tool_call_id="call_1", name="magic_function"),
    ]
    answer = chat.bind_tools([magic_function], tool_choice="none").invoke(messages)
    assert answer.tool_calls == [] and "5" in answer.content
    # Without the result the model does not know the answer: the result was in the prompt.
    plain = chat.bind_tools([magic_function], tool_choice="none").invoke(messages[:1])
    assert plain.content != answer.content


def test_create_agent_runs_a_retriever_tool(lm: Any) -> None:
    """``langchain.agents.create_agent`` with a retriever tool over the sample documents: the
    first model call is forced to the tool (the 135M model does not pick it under "auto"),
    the tool runs, its documents are in the state, and the model answers after them with
    Tok-RAG, the tool's documents as the retrieved text."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.vectorstores import InMemoryVectorStore

    from tokrag_integrations.langchain import local_embeddings
    from tokrag_integrations.retrieval import chunk_documents, get_sample_docs_path, load_documents

    chunks = chunk_documents(load_documents(get_sample_docs_path()), max_chars=400, overlap=0)
    docs = [Document(page_content=c.text) for c in chunks]
    store = InMemoryVectorStore.from_documents(docs, local_embeddings())
    retriever = store.as_retriever(search_kwargs={"k": 2})

    @tool
    def search_docs(query: str) -> str:
        """Search the company documents."""
        return "\n\n".join(d.page_content for d in retriever.invoke(query))

    @wrap_model_call
    def first_call_searches(request: Any, handler: Any) -> Any:
        searched = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if searched else "search_docs"))

    agent = create_agent(
        model=ChatTokRAG(model=lm, max_tokens=64),
        tools=[search_docs],
        middleware=[first_call_searches],
        system_prompt="Answer from the company documents: search them for the question first.",
    )
    state = agent.invoke({"messages": [HumanMessage("What is the code name of the Kestrel-7 programme?")]})
    messages = state["messages"]
    calls = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    results = [m for m in messages if isinstance(m, ToolMessage)]
    assert calls and calls[0].tool_calls[0]["name"] == "search_docs"
    assert results and "Bramblewick" in results[0].content  # the tool's documents are in the state
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls and final.content
    # The tool's retriever ran in the agent's run: its documents, found in the tool result the
    # model reads, are the retrieved text of the answer (Tok-RAG over the tool's result).
    meta = final.response_metadata
    assert meta["policy"] == "tokrag" and meta["retrieval"]["source"] == "retriever"
    assert meta["retrieval"]["found"] == 2
    assert "Bramblewick" in "".join(p["text"] for p in meta["trace"]["passages"])
