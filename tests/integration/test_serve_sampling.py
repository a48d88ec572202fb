"""Issue 57 on ``tokrag serve``: sampling, log-probabilities, ``n``, ``response_format`` and
tools through real clients (the ``openai`` package, LangChain's ``ChatOpenAI``, LlamaIndex's
``OpenAILike``, the package's own ``RemoteModel``) against a real server on the packaged model,
every answer compared with the core's own decode of the same request.

One uvicorn server for the module (in a thread, on a free port, answering with the session's
shared model). Cases that need no model: ``tests/unit/test_serve_sampling.py``."""

from __future__ import annotations

import json

import pytest
from _helpers import LiveServer, require

require("fastapi")
require("uvicorn")
require("llguidance")
openai = require("openai")
httpx = require("httpx")

from pydantic import BaseModel, Field  # noqa: E402

from tokrag_integrations import generate  # noqa: E402
from tokrag_integrations.defaults import ANSWER_STOP  # noqa: E402

DOCS = [
    "Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø, Norway.",
    "The company builds reusable sounding rockets for atmospheric research.",
]
QUESTION = "Who founded Quillfeather Aerospace?"
MAX_TOKENS = 16
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Oslo", "Bergen", "Tromsø"]}}, "required": ["city"]}}}


class Founder(BaseModel):
    """Who founded a company, and when."""

    name: str = Field(max_length=32)
    year: int = Field(ge=1800, le=2100)


@pytest.fixture(scope="module")
def server(lm):
    from tokrag_integrations.server import ChatService, ServeConfig, create_app

    service = ChatService(lm, ServeConfig(max_new_tokens=MAX_TOKENS))
    live = LiveServer(create_app(service))
    live.service = service
    yield live
    live.stop()


def _ask(client, question=QUESTION, documents=DOCS, **kw):
    extra = dict(kw.pop("extra_body", {}))
    if documents is not None:
        extra["documents"] = documents
    messages = kw.pop("messages", [{"role": "user", "content": question}])
    return client.chat.completions.create(
        model="default", messages=messages, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
        extra_body=extra, **kw,
    )


def _same_logprobs(got, want):
    """Equal tokens, bytes and alternatives; log-probabilities equal up to float32 rounding."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g["token"], g["bytes"]) == (w["token"], w["bytes"])
        assert g["logprob"] == pytest.approx(w["logprob"], rel=1e-5, abs=1e-6)
        assert [a["token"] for a in g["top_logprobs"]] == [a["token"] for a in w["top_logprobs"]]
        assert [a["logprob"] for a in g["top_logprobs"]] == pytest.approx(
            [a["logprob"] for a in w["top_logprobs"]], rel=1e-5, abs=1e-6)


def _local(lm, question=QUESTION, documents=DOCS, max_new_tokens=MAX_TOKENS, **kw):
    return generate(lm, question, documents, policy="tokrag", max_new_tokens=max_new_tokens,
                    stop=list(ANSWER_STOP), **kw)


# ============================================================================ sampling
def test_seeded_sampling_repeats_and_equals_the_local_decode(server, lm):
    client = server.client()
    first, second = _ask(client, **SAMPLED), _ask(client, **SAMPLED)
    want = _local(lm, **SAMPLED)
    assert first.choices[0].message.content == second.choices[0].message.content == want.text
    t = first.model_extra["tokrag"]
    assert [s["token_id"] for s in t["trace"]["steps"]] == want.token_ids
    assert [s["source"] for s in t["trace"]["steps"]] == [s.source for s in want.trace.steps]
    assert t["sampling"]["seed"] == 1234 and t["sampling"]["temperature"] == 0.9
    greedy = _local(lm)
    other = _ask(client, **{**SAMPLED, "seed": 99}).choices[0].message.content
    # a sampled answer is not the greedy one for every seed (the draw is not ignored)
    assert {want.text, other} != {greedy.text}


def test_temperature_zero_and_absent_stay_greedy(server, lm):
    client = server.client()
    greedy = _local(lm).text
    assert _ask(client).choices[0].message.content == greedy
    assert _ask(client, temperature=0, seed=5).choices[0].message.content == greedy
    assert _ask(client).model_extra["tokrag"]["sampling"] == {}


def test_vllm_top_k_is_honoured(server, lm):
    r = _ask(server.client(), **SAMPLED, extra_body={"top_k": 5})
    assert r.choices[0].message.content == _local(lm, **SAMPLED, top_k=5).text
    assert r.model_extra["tokrag"]["sampling"]["top_k"] == 5


# ============================================================================ logprobs
def test_logprobs_and_top_logprobs_match_the_trace_and_the_local_decode(server, lm):
    r = _ask(server.client(), logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    want = _local(lm, top_logprobs=3)
    assert len(content) == len(want.token_ids) == r.usage.completion_tokens
    _same_logprobs([c.model_dump() for c in content], want.logprobs)
    for c in content:
        assert c.logprob <= 0 and len(c.top_logprobs) == 3
        tops = [a.logprob for a in c.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy: the chosen token is the best of the distribution it was taken from
        assert c.token == c.top_logprobs[0].token and c.logprob == pytest.approx(tops[0])
    assert _ask(server.client()).choices[0].logprobs is None  # not asked: none


def test_streamed_logprobs_equal_the_plain_answers(server):
    client = server.client()
    plain = _ask(client, logprobs=True, top_logprobs=2).choices[0].logprobs.content
    chunks = [c for c in _ask(client, logprobs=True, top_logprobs=2, stream=True)
              if c.choices and c.choices[0].logprobs is not None]
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in plain]


# ============================================================================ n
def test_n_sampled_choices_are_seed_plus_i_draws(server, lm):
    r = _ask(server.client(), n=2, **SAMPLED)
    assert [c.index for c in r.choices] == [0, 1]
    wants = [_local(lm, **{**SAMPLED, "seed": SAMPLED["seed"] + i}) for i in range(2)]
    assert [c.message.content for c in r.choices] == [w.text for w in wants]
    assert [c.model_extra["tokrag"]["sampling"]["seed"] for c in r.choices] == [1234, 1235]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in wants)


def test_n_greedy_choices_are_one_answer_and_say_so(server, lm):
    r = _ask(server.client(), n=3)
    assert [c.message.content for c in r.choices] == [_local(lm).text] * 3
    assert any("n=3 with greedy decoding" in w for w in r.model_extra["tokrag"]["warnings"])


def test_n_streamed_choices_each_rebuild_their_answer(server, lm):
    chunks = list(_ask(server.client(), n=2, stream=True, **SAMPLED))
    texts = ["", ""]
    finished = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert texts == [_local(lm, **{**SAMPLED, "seed": 1234 + i}).text for i in range(2)]
    assert set(finished) == {0, 1}


# ============================================================================ response_format
def test_json_schema_answer_parses_and_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "Founder",
                                                  "schema": Founder.model_json_schema()}}
    for kw in ({}, SAMPLED):
        r = _ask(server.client(), max_tokens=48, response_format=fmt, **kw)
        founder = Founder.model_validate_json(r.choices[0].message.content)
        assert founder.year >= 1800
        assert r.choices[0].finish_reason == "stop"  # the grammar ended it, not max_tokens


def test_json_object_answer_parses(server):
    r = _ask(server.client(), max_tokens=48, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_the_library_cannot_compile_is_a_400(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}
    with pytest.raises(openai.BadRequestError) as info:
        _ask(server.client(), response_format=bad)
    assert info.value.body["param"] == "response_format"
    assert server.health()["active"] == 0


# ============================================================================ tools
def test_required_tool_choice_gives_parsable_tool_calls(server):
    r = _ask(server.client(), "What is the weather in Oslo?", None, max_tokens=48,
             tools=[WEATHER], tool_choice="required")
    choice = r.choices[0]
    cut = r.model_extra["tokrag"]["stop_reason"] == "length"  # a later call cut by max_tokens
    assert choice.finish_reason == ("length" if cut else "tool_calls")
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        assert json.loads(call.function.arguments)["city"] in ("Oslo", "Bergen", "Tromsø")


def test_one_call_without_parallel_tool_calls(server):
    """The packaged model goes on calling after its first call until max_tokens; with
    ``parallel_tool_calls: false`` the decode ends where the first call does."""
    kw = {"max_tokens": 48, "tools": [WEATHER], "tool_choice": "required"}
    many = _ask(server.client(), "Weather in Oslo?", None, **kw).choices[0]
    one = _ask(server.client(), "Weather in Oslo?", None, parallel_tool_calls=False, **kw).choices[0]
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1
    assert one.message.content is None
    assert one.message.tool_calls[0].function.arguments == many.message.tool_calls[0].function.arguments


def test_a_tool_result_in_the_history_is_answered(server):
    history = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
    ]
    r = _ask(server.client(), documents=None, messages=history, tools=[WEATHER],
             tool_choice="none")
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_streamed_tool_calls_arrive_as_delta_tool_calls(server):
    chunks = list(_ask(server.client(), "Weather in Bergen?", None, max_tokens=48,
                       tools=[WEATHER], tool_choice={"type": "function",
                                                      "function": {"name": "get_weather"}},
                       parallel_tool_calls=False, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert "city" in json.loads(calls[0].function.arguments)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s_naming_the_field(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice.function.name"
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, n=9)
    assert info.value.body["param"] == "n" and "limit of 8" in info.value.body["message"]


# ============================================================================ framework clients
def test_openai_like_with_its_default_temperature(server):
    """LlamaIndex's OpenAILike sends temperature=0.1 unless told otherwise: it got a 400
    before issue 57; now it is a sampled answer, recorded as such."""
    mod = require("llama_index.llms.openai_like", "llama-index-llms-openai-like")
    from llama_index.core.llms import ChatMessage

    llm = mod.OpenAILike(api_base=f"{server.url}/v1", api_key="unused", model="default",
                         is_chat_model=True, max_tokens=MAX_TOKENS, max_retries=0,
                         additional_kwargs={"extra_body": {"documents": DOCS}})
    assert llm.temperature == 0.1
    r = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert r.message.content
    assert r.raw.model_extra["tokrag"]["sampling"]["temperature"] == 0.1


def test_chat_openai_bind_tools_and_structured_output(server):
    lc = require("langchain_openai", "langchain-openai")
    chat = lc.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model="default",
                         max_tokens=48, max_retries=0)

    def get_weather(city: str) -> str:
        """The current weather in a city (Oslo, Bergen or Tromsø)."""
        return "sunny"

    msg = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    founder = chat.with_structured_output(Founder).invoke(
        f"{DOCS[0]}\n\nWho founded Quillfeather Aerospace, and in which year?")
    assert isinstance(founder, Founder)


def test_remote_model_sends_the_new_fields_and_reads_the_answer(server, lm):
    from tokrag_integrations.server.client import RemoteModel

    remote = RemoteModel(f"{server.url}/v1", timeout=300)
    got = remote.generate(QUESTION, DOCS, max_new_tokens=MAX_TOKENS, stop=list(ANSWER_STOP),
                          top_logprobs=2, **SAMPLED)
    want = _local(lm, top_logprobs=2, **SAMPLED)
    assert got.text == want.text and got.token_ids == want.token_ids
    _same_logprobs(got.logprobs, want.logprobs)
    assert got.trace.sampling == want.trace.sampling
    spec = {"type": "json_schema", "json_schema": {"name": "Founder",
                                                   "schema": Founder.model_json_schema()}}
    Founder.model_validate_json(remote.generate(QUESTION, DOCS, max_new_tokens=48,
                                                constraint=spec).text)
    # tools: the raw answer comes back (as a local decode gives it) for the caller to parse
    from tokrag_integrations.structured import parse_tool_calls

    called = remote.generate("Weather in Tromsø?", None, max_new_tokens=48, tools=[WEATHER],
                             tool_choice="required")
    _, calls = parse_tool_calls(called.text)
    assert [c["name"] for c in calls] == ["get_weather"]
    stream = remote.stream("Weather in Tromsø?", None, max_new_tokens=48, tools=[WEATHER],
                           tool_choice="required")
    assert "".join(ev.text for ev in stream) == stream.result.text == called.text
