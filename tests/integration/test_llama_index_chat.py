"""TokRAGLLM's chat-model contract on the packaged model (issue 57): sampling, logprobs,
structured output by constrained decoding, tool calls and a ``FunctionAgent`` with a
retriever tool over the sample documents (the translation alone, without a model:
tests/unit/test_llama_index_tools.py)."""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Annotated

import pytest
from _helpers import require, sample_documents

require("llama_index.core", "llama-index-core")
require("llguidance", "llguidance")

from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.response_synthesizers import get_response_synthesizer  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from tokrag_integrations import generate  # noqa: E402
from tokrag_integrations.llama_index import TokRAGLLM, local_embedding  # noqa: E402

FOUNDER_Q = "Who founded Quillfeather Aerospace?"
FOUNDER_A = "Ottoline Varga"
FACT = (
    "Quillfeather Aerospace was founded in 2009 by Ottoline Varga, a former propulsion "
    "engineer, in Dundee, Scotland."
)
QA = PromptTemplate(
    "Context information is below.\n---------------------\n{context_str}\n"
    "---------------------\nGiven the context information and not prior knowledge, answer "
    "the query.\nQuery: {query_str}\nAnswer: "
)
N = 12


@pytest.fixture(scope="module")
def index():
    nodes = SentenceSplitter(chunk_size=256, chunk_overlap=20).get_nodes_from_documents(
        sample_documents()
    )
    return VectorStoreIndex(nodes, embed_model=local_embedding())


@pytest.fixture(scope="module")
def llm(lm):
    return TokRAGLLM(lm, max_new_tokens=N)


# ----------------------------------------------------------------------------- sampling
def test_temperature_zero_is_todays_greedy_answer(lm, llm):
    today = generate(lm, FOUNDER_Q, [FACT], policy="tokrag", max_new_tokens=N)
    for r in (
        llm.complete(FOUNDER_Q, passages=[FACT]),
        llm.complete(FOUNDER_Q, passages=[FACT], temperature=0),
        TokRAGLLM(lm, max_new_tokens=N, temperature=0.0, seed=5).complete(FOUNDER_Q, passages=[FACT]),
    ):
        assert r.text == today.text
        assert [s["token_id"] for s in r.raw["steps"]] == today.token_ids
        assert r.raw["sampling"] == {}  # a greedy trace records no sampling
        assert r.logprobs is None  # not asked for


def test_seeded_sampling_repeats_and_is_recorded(llm):
    kw = {"passages": [FACT], "temperature": 1.0, "top_p": 0.95, "seed": 7}
    first = llm.complete(FOUNDER_Q, **kw)
    assert llm.complete(FOUNDER_Q, **kw).text == first.text
    assert asyncio.run(llm.acomplete(FOUNDER_Q, **kw)).text == first.text
    *_, last = llm.stream_complete(FOUNDER_Q, **kw)
    assert last.text == first.text
    assert first.raw["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 7}
    # The seed decides the draw: four seeds give more than one answer at T = 1.
    answers = {llm.complete(FOUNDER_Q, **{**kw, "seed": s}).text for s in range(4)}
    assert len(answers) > 1
    # Fields are the defaults of every call.
    fixed = TokRAGLLM(llm.loaded_model, max_new_tokens=N, temperature=1.0, top_p=0.95, seed=7)
    assert fixed.complete(FOUNDER_Q, passages=[FACT]).text == first.text


def test_bad_sampling_values_are_refused_naming_the_keyword(llm):
    with pytest.raises(ValueError, match="top_p"):
        llm.complete(FOUNDER_Q, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        llm.complete(FOUNDER_Q, temperature=-1)
    with pytest.raises(ValueError, match="top_logprobs"):
        TokRAGLLM(llm.loaded_model, top_logprobs=50)


# ----------------------------------------------------------------------------- logprobs
def test_logprobs_per_token_with_alternatives(llm):
    r = llm.complete(FOUNDER_Q, passages=[FACT], top_logprobs=3)
    steps = r.raw["steps"]
    assert r.logprobs is not None and len(r.logprobs) == len(steps) > 0
    for entry, step in zip(r.logprobs, steps, strict=True):
        chosen, *alternatives = entry
        assert len(alternatives) == 3
        assert chosen.logprob <= 0 and chosen.logprob == pytest.approx(step["logprob"])
        assert chosen.bytes == list(chosen.token.encode())
        lps = [a.logprob for a in alternatives]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the token is the argmax of the distribution it was taken from.
        assert alternatives[0].token == chosen.token
        assert alternatives[0].logprob == pytest.approx(chosen.logprob)
    assert "".join(e[0].token for e in r.logprobs).strip().startswith(r.text.strip()[:5])
    # Streamed: one token's logprobs per response, the last one all of them.
    *tokens, last = llm.stream_complete(FOUNDER_Q, passages=[FACT], top_logprobs=3)
    assert last.logprobs == r.logprobs
    streamed = [t.logprobs[0] for t in tokens]
    assert [e[0].logprob for e in streamed] == pytest.approx(
        [e[0].logprob for e in r.logprobs[: len(streamed)]]
    )
    # Chat and async carry them too; logprobs=True alone gives the chosen tokens.
    c = llm.chat([ChatMessage(role="user", content=FOUNDER_Q)], logprobs=True)
    assert c.logprobs is not None and len(c.logprobs) == len(c.raw["steps"])
    assert all(len(e) == 1 for e in c.logprobs)
    a = asyncio.run(llm.acomplete(FOUNDER_Q, passages=[FACT], top_logprobs=3))
    assert [e[0].logprob for e in a.logprobs] == pytest.approx([e[0].logprob for e in r.logprobs])


# ----------------------------------------------------------------------------- structured
class Founding(BaseModel):
    """Who founded the company and when."""

    # The 135M model fills "founded_by" with the founder's name and "founder" / "founder_name"
    # with the company's (without the schema in the prompt: with it, it copies the field's
    # description); the grammar fixes the keys, the model the values.
    founded_by: str
    year: int


class Office(BaseModel):
    city: str
    staff: int


class Leave(BaseModel):
    days: int
    carried_over: int


class Kind(str, Enum):
    yes = "yes"
    no = "no"


class Answer(BaseModel):
    builds_launch_vehicles: Kind
    # Unbounded, the 135M model lists (and spells one product) past any budget.
    products: list[Annotated[str, Field(max_length=40)]] = Field(max_length=3)


STRUCTURED = [
    (Founding, "Who founded Quillfeather Aerospace, and in which year?"),
    (Office, "Where is the Kirkwall test range and how many staff does it have?"),
    (Leave, "How many days of annual leave do employees get, and how many can be carried over?"),
    (Answer, "Does Quillfeather build launch vehicles, and what does it build?"),
]


@pytest.mark.parametrize("schema, question", STRUCTURED, ids=lambda v: getattr(v, "__name__", ""))
def test_structured_predict_over_retrieved_nodes_always_parses(lm, index, schema, question):
    llm = TokRAGLLM(lm, max_new_tokens=96)
    nodes = index.as_retriever(similarity_top_k=1).retrieve(question)
    context = "\n\n".join(n.node.get_content() for n in nodes)
    results: list = []
    llm._results = results
    out = llm.structured_predict(schema, QA, context_str=context, query_str=question)
    assert isinstance(out, schema)
    (result,) = results
    assert result.trace.policy == "tokrag"  # the template's context is retrieved text
    assert schema.model_validate_json(result.text) == out
    assert set(result.trace.counts()) <= {"pure", "rag", "agree"}


@pytest.mark.parametrize("policy", ["tokrag", "rag"])
def test_structured_answer_states_the_retrieved_fact(lm, policy):
    llm = TokRAGLLM(lm, max_new_tokens=48, policy=policy)
    out = llm.structured_predict(Founding, QA, context_str=FACT, query_str=FOUNDER_Q)
    assert out.founded_by == FOUNDER_A and out.year == 2009


def test_as_structured_llm_async_and_streaming(lm):
    llm = TokRAGLLM(lm, max_new_tokens=48, policy="rag")
    sllm = llm.as_structured_llm(Founding)
    ask = [ChatMessage(role="user", content=f"{FACT}\n\n{FOUNDER_Q}")]
    r = sllm.chat(ask)
    assert isinstance(r.raw, Founding)
    assert json.loads(r.message.content) == r.raw.model_dump()
    a = asyncio.run(llm.astructured_predict(Founding, QA, context_str=FACT, query_str=FOUNDER_Q))
    s = llm.structured_predict(Founding, QA, context_str=FACT, query_str=FOUNDER_Q)
    assert a == s
    *partials, last = llm.stream_structured_predict(
        Founding, QA, context_str=FACT, query_str=FOUNDER_Q
    )
    assert last == s and partials  # partial objects came first
    assert all(type(p).__name__ != "Founding" for p in partials)


def test_an_answer_cut_by_max_new_tokens_says_so(lm):
    with pytest.raises(ValueError, match="max_new_tokens=4"):
        TokRAGLLM(lm, max_new_tokens=4).structured_predict(
            Founding, QA, context_str=FACT, query_str=FOUNDER_Q
        )


# ----------------------------------------------------------------------------- tools
def _search_tool(index, calls: list[str]):
    retriever = index.as_retriever(similarity_top_k=1)

    def search_docs(query: str) -> str:
        """Search Quillfeather Aerospace's handbook.

        Args:
            query: the user's question, word for word.
        """
        calls.append(query)
        return "\n\n".join(n.node.get_content() for n in retriever.retrieve(query))

    return FunctionTool.from_defaults(fn=search_docs)


def test_chat_with_tools_calls_the_tool_under_its_schema(lm, index):
    llm = TokRAGLLM(lm, max_new_tokens=64)
    tool = _search_tool(index, [])
    assert llm.metadata.is_function_calling_model
    r = llm.chat_with_tools([tool], user_msg=FOUNDER_Q, tool_required=True)
    (call,) = llm.get_tool_calls_from_response(r)
    assert call.tool_name == "search_docs" and isinstance(call.tool_kwargs.get("query"), str)
    assert call.tool_id  # an id to answer with
    blocks = [b for b in r.message.blocks if isinstance(b, ToolCallBlock)]
    assert blocks[0].tool_kwargs == call.tool_kwargs
    # The same call streamed: no tool-call text in the deltas, the call in the last response.
    *chunks, last = llm.stream_chat_with_tools([tool], user_msg=FOUNDER_Q, tool_required=True)
    assert "<tool_call>" not in "".join(c.delta or "" for c in chunks)
    assert llm.get_tool_calls_from_response(last)[0].tool_kwargs == call.tool_kwargs
    # Naming the tool is the same as requiring it here; an unknown name is refused.
    named = llm.chat_with_tools([tool], user_msg=FOUNDER_Q, tool_choice="search_docs")
    assert llm.get_tool_calls_from_response(named)[0].tool_name == "search_docs"
    with pytest.raises(ValueError, match="search_docs"):
        llm.chat_with_tools([tool], user_msg=FOUNDER_Q, tool_choice="nope")
    # predict_and_call runs it.
    out = llm.predict_and_call([tool], user_msg=FOUNDER_Q, tool_required=True)
    assert out.sources and out.sources[0].tool_name == "search_docs"


def test_tool_results_are_decoded_as_retrieved_text(lm, index):
    llm = TokRAGLLM(lm, max_new_tokens=64, max_tool_rounds=1)
    calls: list[str] = []
    tool = _search_tool(index, calls)
    r = llm.chat_with_tools([tool], user_msg=FOUNDER_Q, tool_required=True)
    (call,) = llm.get_tool_calls_from_response(r)
    output = tool.call(**call.tool_kwargs)
    history = [
        ChatMessage(role="user", content=FOUNDER_Q),
        r.message,
        ChatMessage(
            role="tool", content=str(output), additional_kwargs={"tool_call_id": call.tool_id}
        ),
    ]
    answer = llm.chat_with_tools([tool], chat_history=history)
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []
    assert answer.raw["policy"] == "tokrag"
    (passage,) = answer.raw["passages"]
    assert passage["metadata"] == {"source": "tool result", "tool_call_id": call.tool_id}
    assert passage["kept"] and passage["text"] == str(output)


def test_function_agent_runs_a_retriever_tool_end_to_end(lm, index):
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult

    calls: list[str] = []
    # A 135M model does not choose tools reliably under "auto": the first turn must call the
    # tool (initial_tool_choice), and after one round of results the model answers.
    llm = TokRAGLLM(lm, max_new_tokens=64, max_tool_rounds=1)
    agent = FunctionAgent(
        tools=[_search_tool(index, calls)],
        llm=llm,
        initial_tool_choice="search_docs",
        allow_parallel_tool_calls=False,  # one call, ended by its closing tag
        system_prompt="You answer questions about Quillfeather Aerospace.",
    )

    async def run():
        handler = agent.run(user_msg=FOUNDER_Q)
        events = [ev async for ev in handler.stream_events()]
        return await handler, events

    response, events = asyncio.run(run())
    results = [e for e in events if isinstance(e, ToolCallResult)]
    assert len(calls) == len(results) == 1 and results[0].tool_name == "search_docs"
    output = str(results[0].tool_output.content)
    assert output.strip()
    # The answer was decoded under tokrag with the tool's result as the retrieved text (what
    # the 135M model asks the tool for is its own choice: not checked).
    assert response.raw["policy"] == "tokrag"
    (passage,) = response.raw["passages"]
    assert passage["text"] == output and passage["kept"]
    assert passage["metadata"]["tool_call_id"] == results[0].tool_id
    assert response.response.content.strip()
    assert [t.tool_name for t in response.tool_calls] == ["search_docs"]  # the run's calls


# ----------------------------------------------------------------------------- synthesizer
def test_llamaindex_synthesizer_with_retrieved_nodes_still_decodes_tokrag(lm, index):
    llm = TokRAGLLM(lm, max_new_tokens=N)
    engine = RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=1),
        response_synthesizer=get_response_synthesizer(llm=llm, response_mode="compact"),
    )
    r = engine.query(FOUNDER_Q)
    assert r.metadata["policy_used"] == "tokrag"
    assert r.source_nodes and r.response.strip()
