"""``TokRAGLLM(base_url=...)`` and ``ChatTokRAG(base_url=...)`` against a real ``tokrag serve``
process (the packaged model, a free port, an API key): the same answers, metadata and traces
as the local classes on the same inputs, streaming, async and batch included; retries on 429
and 503 honouring ``Retry-After`` (through a small proxy that refuses once); clear errors;
the API key never shown.

Cases that need no server are in ``tests/unit/test_remote.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from _helpers import CheckedThread, interrupt, require, wait_until_healthy

require("fastapi")
require("uvicorn")
require("openai")
httpx = require("httpx")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from tokrag_integrations.langchain import ChatTokRAG  # noqa: E402
from tokrag_integrations.llama_index import TokRAGLLM, local_embedding  # noqa: E402
from tokrag_integrations.trace import comparable  # noqa: E402

KEY = "s3cret-remote-key-4242"
DOCS = [
    "Quillfeather Aerospace was founded in 1987 by the engineer Mara Ellison in Tromsø, Norway.",
    "The company builds reusable sounding rockets for atmospheric research.",
]
QUESTION = "Who founded Quillfeather Aerospace?"
N = 10  # new tokens per answer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A real ``tokrag serve`` process on the packaged model, with an API key."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKRAG_API_KEY=KEY)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            wait_until_healthy(proc, port, log_path)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            interrupt(proc)


def _close(a, b) -> bool:
    """Equal, floats up to float32 rounding: the server runs torch on one thread, the test
    process on several, so sums are added in another order (tokens and decisions are equal)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _same_trace(remote: dict, local: dict) -> None:
    # Less the decode's own times and what each process measured about speed: the server's
    # first decode may run before its speed paths are measured, the local one after.
    assert remote["steps"] and _close(comparable(remote), comparable(local))
    assert [(s["token_id"], s["source"]) for s in remote["steps"]] == [
        (s["token_id"], s["source"]) for s in local["steps"]
    ]


def _same_metadata(remote: dict, local: dict) -> None:
    floats = ("trace", "citations")  # equal up to float32 rounding (_close)
    assert {k: v for k, v in remote.items() if k not in floats} == {
        k: v for k, v in local.items() if k not in floats
    }
    assert _close(remote.get("citations"), local.get("citations"))
    _same_trace(remote["trace"], local["trace"])


# ------------------------------------------------------------------ LlamaIndex
_LOCAL: dict = {}


def _local(llm, question, **kw):
    """The local class's answer with the passages, decoded once per module per input."""
    key = (question, repr(sorted(kw.items())))
    if key not in _LOCAL:
        _LOCAL[key] = llm.complete(question, passages=DOCS, **kw)
    return _LOCAL[key]


@pytest.fixture(scope="module")
def llms(server, lm):
    return TokRAGLLM(base_url=server, api_key=KEY, max_new_tokens=N), TokRAGLLM(
        lm, max_new_tokens=N
    )


def test_llm_complete_chat_and_stream_equal_the_local_class(llms):
    remote, local = llms
    r, want = remote.complete(QUESTION, passages=DOCS), _local(local, QUESTION)
    assert r.text == want.text and r.additional_kwargs == want.additional_kwargs
    assert want.additional_kwargs["policy"] == "tokrag"
    _same_trace(r.raw, want.raw)
    assert remote.metadata == local.metadata  # the window and chat flag the prompt helper reads
    msgs = [
        ChatMessage(role="system", content="Answer briefly."),
        ChatMessage(role="user", content=QUESTION),
    ]
    c, cw = remote.chat(msgs, passages=DOCS), local.chat(msgs, passages=DOCS)
    assert c.message.content == cw.message.content
    _same_trace(c.raw, cw.raw)
    streamed = list(remote.stream_complete(QUESTION, passages=DOCS))
    assert "".join(s.delta for s in streamed) == want.text
    assert all(s.additional_kwargs["source"] in ("agree", "rag", "pure") for s in streamed[:-1])
    _same_trace(streamed[-1].raw, want.raw)


async def test_llm_concurrent_async_calls_equal_the_local_class(llms):
    remote, local = llms
    q2 = "Where was Quillfeather Aerospace founded?"
    a, b = await asyncio.gather(
        remote.acomplete(QUESTION, passages=DOCS), remote.acomplete(q2, passages=DOCS)
    )
    assert a.text == _local(local, QUESTION).text
    assert b.text == local.complete(q2, passages=DOCS).text
    tokens = [t.delta async for t in await remote.astream_complete(q2, passages=DOCS)]
    assert "".join(tokens) == b.text


def test_query_engine_template_path_equals_the_local_class(llms):
    """LlamaIndex formats its template with the retrieved context: the formatted prompt and
    its context travel as ``tokrag.rendered``."""
    remote, local = llms
    nodes = [TextNode(text=t, id_=f"n{i}") for i, t in enumerate(DOCS)]
    index = VectorStoreIndex(nodes, embed_model=local_embedding())
    want = index.as_query_engine(llm=local, similarity_top_k=2).query(QUESTION)
    got = index.as_query_engine(llm=remote, similarity_top_k=2).query(QUESTION)
    assert str(got) == str(want) and got.metadata["policy_used"] == "tokrag"
    # Each node travels as its own passage (tokrag.rendered.passages): the same citations.
    def cited(r):
        return [(c["text"], c["passage"], c["metadata"].get("node_id")) for c in r.metadata["citations"]]

    assert cited(got) == cited(want) and any(c[2] for c in cited(want))
    assert [n.node.node_id for n in got.source_nodes] == [n.node.node_id for n in want.source_nodes]
    streamed = index.as_query_engine(llm=remote, similarity_top_k=2, streaming=True).query(QUESTION)
    assert "".join(streamed.response_gen) == str(want)
    assert streamed.metadata["policy_used"] == "tokrag"


# ------------------------------------------------------------------ LangChain
@pytest.fixture(scope="module")
def chats(server, lm):
    return ChatTokRAG(base_url=server, api_key=KEY, max_tokens=N), ChatTokRAG(
        model=lm, max_tokens=N
    )


def test_chat_invoke_stream_and_context_equal_the_local_class(chats):
    remote, local = chats
    docs = [Document(page_content=t, metadata={"source": f"d{i}"}) for i, t in enumerate(DOCS)]
    r, want = remote.invoke(QUESTION, passages=docs), local.invoke(QUESTION, passages=docs)
    assert r.content == want.content and r.usage_metadata == want.usage_metadata
    _same_metadata(r.response_metadata, want.response_metadata)
    chunks = list(remote.stream(QUESTION, passages=docs))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == want.content
    assert full.response_metadata["token_sources"] == want.response_metadata["token_sources"]
    # A template formatted by the caller: context= / question= (what LangChain chains pass).
    context = "\n\n".join(DOCS)
    msgs = [
        SystemMessage(f"Use this context to answer.\n\n{context}"),
        HumanMessage(QUESTION),
    ]
    r = remote.invoke(msgs, context=context, question=QUESTION)
    want = local.invoke(msgs, context=context, question=QUESTION)
    assert r.content == want.content and r.response_metadata["policy"] == "tokrag"
    _same_metadata(r.response_metadata, want.response_metadata)


def test_chat_async_and_batch_equal_the_local_class(chats):
    remote, local = chats
    bound_r, bound_l = remote.bind(passages=DOCS), local.bind(passages=DOCS)
    qs = [QUESTION, "What does Quillfeather Aerospace build?"]
    want = [m.content for m in bound_l.batch(qs)]
    assert [m.content for m in bound_r.batch(qs)] == want

    async def run():
        got = await bound_r.abatch(qs)
        text = "".join([c.content async for c in bound_r.astream(qs[0])])
        return [m.content for m in got], text

    got, text = asyncio.run(run())
    assert got == want and text == want[0]


def test_langchain_rag_recipe_on_a_remote_chat_equals_the_local_one(chats):
    """LangChain's own LCEL recipe (retriever | format_docs into the prompt): the documents the
    run retrieved are found in the prompt remotely as locally (``context=`` travels as
    ``tokrag.rendered``), so the server decodes Tok-RAG with the same answer and trace."""
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from langchain_core.runnables import RunnablePassthrough

    class Fixed(BaseRetriever):
        def _get_relevant_documents(
            self, query: str, *, run_manager: CallbackManagerForRetrieverRun
        ) -> list[Document]:
            return [Document(page_content=t) for t in DOCS]

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
    )

    def chain(chat):
        docs = Fixed() | (lambda ds: "\n\n".join(d.page_content for d in ds))
        return {"context": docs, "question": RunnablePassthrough()} | prompt | chat

    remote, local = chats
    r, want = chain(remote).invoke(QUESTION), chain(local).invoke(QUESTION)
    assert r.response_metadata["policy"] == "tokrag"
    assert r.response_metadata["retrieval"] == want.response_metadata["retrieval"]
    assert r.response_metadata["retrieval"]["found"] == len(DOCS)
    assert r.content == want.content
    # The rendered prompt's documents travel (tokrag.rendered.passages): each is one passage.
    assert len(want.response_metadata["trace"]["passages"]) == len(DOCS)
    _same_metadata(r.response_metadata, want.response_metadata)
    assert (chain(remote) | StrOutputParser()).batch([QUESTION, QUESTION]) == [want.content] * 2


# ------------------------------------------------------------------ citations (issue 46)
def test_remote_citations_equal_a_local_decode(server, lm):
    """``citations=`` reaches the server (``rag`` cites only when asked): on issue 46's
    acceptance case the remote trace, plain or streamed, gives the local decode's citations,
    the fact cited to the second passage, the one that holds it."""
    from tokrag_integrations import generate
    from tokrag_integrations.server.client import RemoteModel

    from .test_citations import ON_TOPIC, WITH_FACT, _fact_steps
    from .test_citations import QUESTION as CITE_QUESTION

    remote, docs = RemoteModel(server, api_key=KEY), [ON_TOPIC, WITH_FACT]
    kw = {"policy": "rag", "max_new_tokens": 14, "citations": True}
    local = generate(lm, CITE_QUESTION, docs, **kw)
    streamed = remote.stream(CITE_QUESTION, docs, **kw)
    assert "".join(e.text for e in streamed) == local.text
    for r in (remote.generate(CITE_QUESTION, docs, **kw), streamed.result):
        assert r.text == local.text
        assert _close(r.trace.citations_data(), local.trace.citations_data())
        assert r.trace.cite(*_fact_steps(r.trace))[0] == 1
    off = remote.generate(CITE_QUESTION, docs, policy="rag", max_new_tokens=4)
    assert off.trace.steps and all(c.passage is None for c in off.trace.citations())


# ------------------------------------------------------------------ issue 57 on the command's server
def test_seeded_sampling_and_logprobs_through_the_served_command_equal_a_local_decode(server, lm):
    """The ``tokrag serve`` process draws what an in-process ``generate`` draws with the same
    seed, through the ``openai`` client and ``RemoteModel``; ``n`` choices are ``seed + i``."""
    import openai

    from tokrag_integrations import generate
    from tokrag_integrations.server.client import RemoteModel

    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 4242}
    local = [generate(lm, QUESTION, DOCS, max_new_tokens=N, stop=[], top_logprobs=2,
                      **{**kw, "seed": 4242 + i}) for i in range(2)]
    client = openai.OpenAI(base_url=server, api_key=KEY, max_retries=0, timeout=300)
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": QUESTION}], max_tokens=N,
        stop=[], n=2, logprobs=True, top_logprobs=2, extra_body={"documents": DOCS}, **kw)
    assert [c.message.content for c in r.choices] == [w.text for w in local]
    got = [(e.token, [a.token for a in e.top_logprobs]) for e in r.choices[0].logprobs.content]
    assert got == [(e["token"], [a["token"] for a in e["top_logprobs"]]) for e in local[0].logprobs]
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx(
        [e["logprob"] for e in local[0].logprobs], rel=1e-4, abs=1e-6)
    remote = RemoteModel(server, api_key=KEY)
    again = remote.generate(QUESTION, DOCS, max_new_tokens=N, stop=[], top_logprobs=2, **kw)
    assert again.token_ids == local[0].token_ids and again.trace.sampling == local[0].trace.sampling


def test_openai_clients_with_their_defaults_against_the_served_command(server):
    """What issue 57 found failing: LlamaIndex's OpenAILike (default temperature 0.1: a 400
    before), and LangChain's ChatOpenAI with bind_tools and with_structured_output."""
    from pydantic import BaseModel, Field

    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    lc = pytest.importorskip("langchain_openai")
    llm = openai_like.OpenAILike(api_base=server, api_key=KEY, model="default",
                                 is_chat_model=True, max_tokens=N, max_retries=0,
                                 additional_kwargs={"extra_body": {"documents": DOCS}})
    r = llm.chat([ChatMessage(role="user", content=QUESTION)])
    assert r.message.content and r.raw.model_extra["tokrag"]["sampling"]["temperature"] == 0.1

    class Founder(BaseModel):
        name: str = Field(max_length=32)
        year: int = Field(ge=1800, le=2100)

    def company_founder(company: str) -> str:
        """Who founded a company."""
        return "Mara Ellison"

    chat = lc.ChatOpenAI(base_url=server, api_key=KEY, model="default", max_tokens=48,
                         max_retries=0)
    msg = chat.bind_tools([company_founder], tool_choice="required").invoke(QUESTION)
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "company_founder"
    assert isinstance(msg.tool_calls[0]["args"].get("company"), str)
    founder = chat.with_structured_output(Founder).invoke(f"{DOCS[0]}\n\n{QUESTION} When?")
    assert isinstance(founder, Founder)


# ------------------------------------------------------------------ retries and errors
class _RefuseOnce(BaseHTTPRequestHandler):
    """Answers the first completion with ``status`` and ``Retry-After: 2``, then proxies
    every request to the server."""

    def do_GET(self):  # noqa: N802 - http.server's names
        self._answer(*self._forward("GET", None))

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.hits.append(time.monotonic())
        if len(self.server.hits) == 1:
            busy = json.dumps({"error": {"message": "busy", "type": "x"}}).encode()
            self._answer(self.server.status, busy, {"Retry-After": "2"})
        else:
            self._answer(*self._forward("POST", body))

    def _forward(self, method, body):
        r = httpx.request(
            method,
            self.server.upstream + self.path.removeprefix("/v1"),
            content=body,
            headers={
                k: self.headers[k] for k in ("authorization", "content-type") if k in self.headers
            },
            timeout=120,
        )
        return r.status_code, r.content, {}

    def _answer(self, status, data, headers):
        self.send_response(status)
        for k, v in {**headers, "content-type": "application/json"}.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [429, 503])
def test_a_refused_request_is_retried_after_retry_after(server, llms, status):
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _RefuseOnce)
    proxy.hits, proxy.status, proxy.upstream = [], status, server
    serving = CheckedThread(target=proxy.serve_forever, name="proxy", daemon=True)
    serving.start()
    try:
        llm = TokRAGLLM(
            base_url=f"http://127.0.0.1:{proxy.server_port}/v1", api_key=KEY, max_new_tokens=4
        )
        r = llm.complete(QUESTION, passages=DOCS)
    finally:
        proxy.shutdown()
        serving.join(60)  # what serve_forever raised, if anything
    assert len(proxy.hits) == 2
    assert proxy.hits[1] - proxy.hits[0] >= 2  # the server's Retry-After, not the backoff
    assert r.text == _local(llms[1], QUESTION, max_new_tokens=4).text


def test_errors_are_sentences_and_the_key_is_never_shown(server, caplog):
    wrong = TokRAGLLM(base_url=server, api_key="not-" + KEY, max_retries=0)
    with pytest.raises(PermissionError, match="refused the API key") as e401:
        wrong.complete(QUESTION, passages=DOCS)
    chat = ChatTokRAG(base_url=server, api_key=KEY, max_tokens=2)
    with pytest.raises(ValueError, match="refused the request: .*limit of 512") as e400:
        chat.invoke(QUESTION, passages=DOCS, max_tokens=600)
    down = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(ConnectionError, match=f"cannot connect to the tokrag server at {down}"):
        ChatTokRAG(base_url=down, api_key=KEY, max_retries=0).invoke(QUESTION, passages=DOCS)
    with caplog.at_level(logging.DEBUG):
        chat.invoke(QUESTION, passages=DOCS)
    shown = [repr(chat), str(chat), repr(wrong), str(e401.value), str(e400.value), caplog.text]
    shown += [json.dumps(chat.model_dump(), default=str), wrong.to_json()]
    assert caplog.text and not any(KEY in s for s in shown)


def test_framework_classes_call_tools_and_decode_schemas_through_the_served_command(server, lm):
    """``ChatTokRAG(base_url=)`` and ``TokRAGLLM(base_url=)`` send tools, the tool choice and
    the schema; the server renders, constrains and returns the call, which each class parses
    as its local twin does (issue 57)."""
    from langchain_core.tools import tool
    from llama_index.core.tools import FunctionTool
    from pydantic import BaseModel

    @tool
    def search_docs(query: str) -> str:
        """Search the company documents."""
        return query

    chats = (ChatTokRAG(base_url=server, api_key=KEY, max_tokens=64), ChatTokRAG(model=lm, max_tokens=64))
    llms = (TokRAGLLM(base_url=server, api_key=KEY, max_new_tokens=64), TokRAGLLM(lm, max_new_tokens=64))
    for chat in chats:
        msg = chat.bind_tools([search_docs], tool_choice="search_docs").invoke(QUESTION)
        assert [c["name"] for c in msg.tool_calls] == ["search_docs"]
        assert isinstance(msg.tool_calls[0]["args"].get("query"), str)
    calls = [
        c.bind_tools([search_docs], tool_choice="search_docs").invoke(QUESTION).tool_calls
        for c in chats
    ]
    assert calls[0][0]["args"] == calls[1][0]["args"]

    class Founder(BaseModel):
        founded_by: str

    shaped = [c.with_structured_output(Founder).invoke(QUESTION) for c in chats]
    assert all(isinstance(s, Founder) for s in shaped) and shaped[0] == shaped[1]

    def search(query: str) -> str:
        """Search the company documents."""
        return query

    fn = FunctionTool.from_defaults(fn=search)
    selections = []
    for llm in llms:
        r = llm.chat_with_tools([fn], user_msg=QUESTION, tool_required=True)
        picked = llm.get_tool_calls_from_response(r, error_on_no_tool_call=True)
        assert [s.tool_name for s in picked] == ["search"]
        selections.append(picked[0].tool_kwargs)
    assert selections[0] == selections[1]
