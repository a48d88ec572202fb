"""LlamaIndex adapters on the real default model (SmolLM2-135M-Instruct) and real indexes.

Retrieval is real (a ``VectorStoreIndex`` over the packaged sample documents with the
packaged MiniLM embedding, and ``llama-index-retrievers-bm25``); every answer comes from the
real model. Answers are kept short (≤ 20 new tokens) because the CI machine is a small CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from _helpers import forward_inputs, require, sample_documents

require("llama_index.core", "llama-index-core")

import llama_index.core.instrumentation as instrument  # noqa: E402
from llama_index.core import Settings, VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402
from llama_index.core.base.response.schema import (  # noqa: E402
    AsyncStreamingResponse,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import Field  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.postprocessor import SimilarityPostprocessor  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

from tokrag_integrations.llama_index import (  # noqa: E402
    TokRAGLLM,
    TokRAGSynthesizer,
    local_embedding,
)

FOUNDER_Q = "Who founded Quillfeather Aerospace?"
FOUNDER_A = "Ottoline Varga"
TOKRAG_Q = "What is the code name of the Kestrel-7 programme?"
TOKRAG_FACT = "Bramblewick"
TOKRAG_TOKENS = 6


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def nodes():
    docs = sample_documents()
    return SentenceSplitter(chunk_size=256, chunk_overlap=20).get_nodes_from_documents(docs)


@pytest.fixture(scope="module")
def index(nodes):
    return VectorStoreIndex(nodes, embed_model=local_embedding())


@pytest.fixture(scope="module")
def rag_synth(lm):
    # 20 tokens: with metadata_mode=LLM (the default) each chunk starts with its file_path
    # line and the model says "founded by a former propulsion engineer, Ottoline Varga".
    return TokRAGSynthesizer(lm, policy="rag", max_new_tokens=20)


@pytest.fixture(scope="module")
def founder_response(index, rag_synth):
    """The non-streaming reference answer every streaming/async variant is compared with."""
    engine = RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=2), response_synthesizer=rag_synth
    )
    return engine.query(FOUNDER_Q)


class _Collect(BaseEventHandler):
    events: list = Field(default_factory=list)

    def handle(self, event, **kwargs):
        self.events.append(event)


@pytest.fixture
def events():
    handler = _Collect()
    root = instrument.get_dispatcher()
    root.add_event_handler(handler)
    try:
        yield handler.events
    finally:
        root.event_handlers.remove(handler)


def _node(text, node_id, score):
    return NodeWithScore(node=TextNode(text=text, id_=node_id), score=score)


# ----------------------------------------------------------------------------- packaging
def test_core_does_not_import_llama_index_and_missing_extra_gives_hint():
    code = (
        "import sys\n"
        "import tokrag_integrations, tokrag_integrations.engine.scheduler, tokrag_integrations.trace\n"
        "assert not any(m == 'llama_index' or m.startswith('llama_index.') for m in sys.modules)\n"
        "sys.modules['llama_index'] = None\n"
        "try:\n"
        "    import tokrag_integrations.llama_index\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'tokrag-integrations[llamaindex]'" in out.stdout


# ----------------------------------------------------------------------------- synthesizer
def test_vector_index_answer_comes_from_retrieval(founder_response):
    r = founder_response
    md = r.metadata
    assert FOUNDER_A in r.response
    assert md["policy"] == "rag" and md["answered_from"] == "retrieval"
    # The chunk holding the fact was retrieved, used, and is a source node.
    used = [n for n in r.source_nodes if n.node.node_id in md["nodes_used"]]
    assert any(FOUNDER_A in n.node.get_content() for n in used)
    # Every generated token is attributed, and they were taken from the RAG context.
    steps = md["trace"]["steps"]
    assert len(steps) == sum(md["counts"].values()) > 0
    assert md["counts"].get("rag", 0) == len(steps)
    assert md["trace"]["passages"][0]["metadata"]["node_id"] == md["nodes_used"][0]


def test_bm25_retriever_answer_and_tokrag_trace(lm, nodes):
    from llama_index.retrievers.bm25 import BM25Retriever

    class Gate:
        def decide(self, query):
            return _Decision(True, 0.8)

    retriever = BM25Retriever.from_defaults(nodes=nodes, similarity_top_k=2)
    # The 135M model states the fact under `rag` (under `tokrag` it keeps the pure model's
    # token at the first content disagreement on every sample question we tried).
    rag = RetrieverQueryEngine(
        retriever=retriever,
        response_synthesizer=TokRAGSynthesizer(lm, policy="rag", max_new_tokens=20),
    )
    r = rag.query(FOUNDER_Q)
    assert FOUNDER_A in r.response
    assert r.metadata["counts"] == {"rag": len(r.metadata["trace"]["steps"])}
    assert any(FOUNDER_A in n.node.get_content() for n in r.source_nodes)

    # The default policy through the same engine: a Tok-RAG trace with both contexts.
    tok = RetrieverQueryEngine(
        retriever=retriever,
        response_synthesizer=TokRAGSynthesizer(lm, max_new_tokens=TOKRAG_TOKENS, gate=Gate()),
    )
    r = tok.query(TOKRAG_Q)
    md = r.metadata
    assert md["policy"] == "tokrag" and md["answered_from"] == "retrieval"
    assert md["gate"] == {"retrieve": True, "score": 0.8, "reason": "test"}
    assert any(TOKRAG_FACT in n.node.get_content() for n in r.source_nodes)
    steps = md["trace"]["steps"]
    assert r.response == md["trace"]["text"] and len(steps) == sum(md["counts"].values()) > 0
    assert set(md["counts"]) <= {"agree", "rag", "pure"} and md["counts"].get("agree", 0) > 0
    assert all(set(st["candidates"]) == {"pure", "rag"} for st in steps)
    split = [st for st in steps if st["source"] != "agree"]
    assert split and all(st["signals"] for st in split)  # disagreements carry Eq. 19 signals


def test_streaming_equals_non_streaming(lm, index, founder_response):
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=20, streaming=True)
    engine = RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=2), response_synthesizer=synth
    )
    r = engine.query(FOUNDER_Q)
    assert isinstance(r, StreamingResponse)
    assert "counts" not in r.metadata  # filled when the stream is exhausted
    chunks = list(r.response_gen)
    assert len(chunks) > 5  # token by token, not one final string
    assert "".join(chunks) == founder_response.response
    assert r.metadata["counts"] == founder_response.metadata["counts"]
    assert r.metadata["policy_used"] == founder_response.metadata["policy_used"] == "rag"
    assert r.metadata["trace"]["text"] == founder_response.response


async def test_async_equals_sync(lm, index, rag_synth, founder_response):
    # as_query_engine needs an LLM; pass the synthesizer's own so no OpenAI default is built.
    engine = index.as_query_engine(
        llm=rag_synth.llm, response_synthesizer=rag_synth, similarity_top_k=2
    )
    r = await engine.aquery(FOUNDER_Q)
    assert r.response == founder_response.response
    assert r.metadata["counts"] == founder_response.metadata["counts"]

    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=20, streaming=True)
    engine = index.as_query_engine(llm=synth.llm, response_synthesizer=synth, similarity_top_k=2)
    rs = await engine.aquery(FOUNDER_Q)
    assert isinstance(rs, AsyncStreamingResponse)
    chunks = [c async for c in rs.async_response_gen()]
    assert len(chunks) > 5
    assert "".join(chunks) == founder_response.response
    assert rs.metadata["counts"] == founder_response.metadata["counts"]


def test_metadata_is_json_serialisable(founder_response):
    md = founder_response.metadata
    back = json.loads(json.dumps(md))
    assert back == md
    for key in ("policy", "counts", "trace", "warnings", "gate", "passages", "model"):
        assert key in md
    assert md["gate"] is None
    assert md["trace"]["policy"] == "rag" and md["trace"]["text"] == founder_response.response


def test_similarity_postprocessor_in_engine(lm, index):
    retriever = index.as_retriever(similarity_top_k=4)
    scores = sorted(n.score for n in retriever.retrieve(FOUNDER_Q))
    cutoff = (scores[-1] + scores[-2]) / 2  # keeps exactly the best node
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=6)
    engine = RetrieverQueryEngine(
        retriever=retriever,
        response_synthesizer=synth,
        node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=cutoff)],
    )
    r = engine.query(FOUNDER_Q)
    assert len(r.source_nodes) == 1
    assert r.metadata["nodes_used"] == [r.source_nodes[0].node.node_id]
    assert r.metadata["answered_from"] == "retrieval" and r.response


# ----------------------------------------------------------------------------- bad input
def test_no_nodes_answers_from_pure_context(lm, index):
    synth = TokRAGSynthesizer(lm, max_new_tokens=6)  # default policy tokrag
    engine = RetrieverQueryEngine(
        retriever=index.as_retriever(similarity_top_k=2),
        response_synthesizer=synth,
        node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=1.01)],  # drops all
    )
    r = engine.query(FOUNDER_Q)
    md = r.metadata
    assert r.response and r.response != "Empty Response"
    assert r.source_nodes == []
    assert md["answered_from"] == "pure_context" and md["policy_used"] == "no_rag"
    assert md["pure_context_reason"] == "no nodes were retrieved"
    assert set(md["counts"]) == {"pure"}
    assert any("pure context" in w for w in md["warnings"])


def test_empty_node_text_is_skipped_with_warning(lm):
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=4)
    good = _node("Quillfeather Aerospace was founded by Ottoline Varga.", "good", 0.4)
    nodes = [_node("   ", "blank", 0.9), good, _node("", "empty", 0.2)]
    with pytest.warns(UserWarning, match="empty"):
        r = synth.synthesize(FOUNDER_Q, nodes)
    md = r.metadata
    assert md["nodes_used"] == ["good"]
    assert md["nodes_skipped_empty"] == ["blank", "empty"]
    assert md["answered_from"] == "retrieval"
    assert sum("empty" in w for w in md["warnings"]) == 2

    with pytest.warns(UserWarning):
        r = synth.synthesize(FOUNDER_Q, [_node(" ", "only", 0.5)])
    assert r.metadata["answered_from"] == "pure_context"
    assert r.metadata["pure_context_reason"] == "no node had usable text"
    assert r.response and r.response != "Empty Response"


def test_nodes_exceeding_window_drop_lowest_scored_first(lm):
    # 180 tokens each
    long = "The Kestrel-7 programme tested thrusters at the Dundee site every week. " * 10
    nodes = [_node(long, "low", 0.1), _node(long, "high", 0.9), _node(long, "mid", 0.5)]
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=4, max_context_tokens=330)
    with pytest.warns(UserWarning, match="do not fit"):
        r = synth.synthesize("Where were thrusters tested?", nodes)
    md = r.metadata
    assert [p["node_id"] for p in md["passages"]] == ["high", "mid", "low"]
    # 32 question tokens + 180 (high) + delimiters leave ~100 tokens: mid is cut, low dropped.
    assert md["nodes_used"] == ["high", "mid"]
    assert md["nodes_cut"] == ["mid"] and md["nodes_dropped"] == ["low"]
    assert any("do not fit" in w for w in md["warnings"])
    assert [n.node.node_id for n in r.source_nodes] == ["low", "high", "mid"]  # as retrieved


def test_gate_saying_no_answers_from_pure_context(lm):
    class Gate:
        def decide(self, query):
            return _Decision(False, 0.1)

    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=4, gate=Gate())
    r = synth.synthesize(
        FOUNDER_Q, [_node("Quillfeather was founded by Ottoline Varga.", "a", 1.0)]
    )
    md = r.metadata
    assert md["gate"] == {"retrieve": False, "score": 0.1, "reason": "test"}
    assert md["answered_from"] == "pure_context" and set(md["counts"]) == {"pure"}


def test_bad_arguments_fail_early(lm):
    with pytest.raises(ValueError, match="Unknown policy"):
        TokRAGSynthesizer(lm, policy="nope")
    with pytest.raises(ValueError, match="max_new_tokens"):
        TokRAGSynthesizer(lm, max_new_tokens=0)
    with pytest.raises(TypeError, match="decide"):
        TokRAGSynthesizer(lm, gate=object())
    with pytest.raises(ValueError, match="last chat message"):
        TokRAGLLM(lm).chat([ChatMessage(role="assistant", content="hi")])


# ----------------------------------------------------------------------------- LLM
def test_llm_metadata(lm):
    llm = TokRAGLLM(lm, max_new_tokens=32)
    md = llm.metadata
    assert md.context_window == lm.context_window == 8192
    assert md.num_output == 32
    assert md.model_name == lm.name
    assert md.is_chat_model is lm.is_chat is True


async def test_llm_complete_chat_stream_async_agree(lm, events):
    llm = TokRAGLLM(lm, max_new_tokens=6)
    prompt = "Name a colour."
    ref = llm.complete(prompt)
    assert ref.text and ref.additional_kwargs["policy"] == "no_rag"
    assert set(ref.additional_kwargs["counts"]) == {"pure"}
    parts = list(llm.stream_complete(prompt))
    assert "".join(p.delta for p in parts) == ref.text and len(parts) > 2
    assert parts[-1].raw["text"] == ref.text  # the final item carries the trace
    assert (await llm.acomplete(prompt)).text == ref.text
    parts = [p async for p in await llm.astream_complete(prompt)]
    assert "".join(p.delta for p in parts) == ref.text

    msgs = [ChatMessage(role="user", content=prompt)]
    chat = llm.chat(msgs)  # the chat template (complete() sends the text as given)
    assert chat.message.content and chat.raw["policy"] == "no_rag"
    assert "".join(p.delta for p in llm.stream_chat(msgs)) == chat.message.content
    assert (await llm.achat(msgs)).message.content == chat.message.content
    parts = [p async for p in await llm.astream_chat(msgs)]
    assert "".join(p.delta for p in parts) == chat.message.content
    names = [e.class_name() for e in events]
    for name in ("LLMCompletionStartEvent", "LLMCompletionEndEvent"):
        assert names.count(name) == 4
    for name in ("LLMChatStartEvent", "LLMChatEndEvent"):
        assert names.count(name) == 4


def test_llm_with_passages_runs_a_policy(lm):
    llm = TokRAGLLM(lm, max_new_tokens=16)
    nodes = [_node("Quillfeather Aerospace was founded by Ottoline Varga in 2011.", "a", 0.9)]
    r = llm.complete(FOUNDER_Q, passages=nodes, policy="rag")
    assert FOUNDER_A in r.text
    assert r.additional_kwargs["policy"] == "rag"
    assert r.raw["passages"][0]["metadata"]["node_id"] == "a"
    earlier = [
        ChatMessage(role="user", content="Hello."),
        ChatMessage(role="assistant", content="Hello! Ask me anything."),
        ChatMessage(role="user", content=FOUNDER_Q),
    ]
    c = llm.chat(earlier, passages=nodes, policy="rag", max_new_tokens=4)
    assert c.additional_kwargs["counts"] == {"rag": 4}


def test_llm_as_settings_llm_with_builtin_compact_mode(lm, index, events):
    old = Settings._llm
    Settings.llm = TokRAGLLM(lm, max_new_tokens=8)
    try:
        # No Tok-RAG synthesizer: LlamaIndex's own compact mode formats its QA prompt.
        engine = index.as_query_engine(response_mode="compact", similarity_top_k=1)
        r = engine.query(FOUNDER_Q)
    finally:
        Settings._llm = old
    assert str(r).strip() and str(r) != "Empty Response"
    names = [e.class_name() for e in events]
    for name in ("SynthesizeStartEvent", "LLMChatStartEvent", "LLMChatEndEvent"):
        assert name in names
    # is_chat_model=True, so the built-in synthesizer called chat() with the retrieved chunk
    # in its prompt, and the end event carries our response.
    start = next(e for e in events if e.class_name() == "LLMChatStartEvent")
    assert r.source_nodes[0].node.get_content()[:80] in start.messages[-1].content
    end = next(e for e in events if e.class_name() == "LLMChatEndEvent")
    assert end.response.message.content.strip() == str(r).strip()
    # The template's context_str reached the decoder: Tok-RAG ran on it.
    assert end.response.additional_kwargs["policy"] == end.response.raw["policy"] == "tokrag"


class _Decision:
    def __init__(self, retrieve, score):
        self.retrieve, self.score = retrieve, score

    def to_dict(self):
        return {"retrieve": self.retrieve, "score": self.score, "reason": "test"}


def test_no_warnings_leak_for_plain_answers(lm):
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synth.synthesize(FOUNDER_Q, [_node("Ottoline Varga founded Quillfeather.", "a", 0.5)])


# ----------------------------------------------------------------------------- raw-prompt path
def _first_forward_ids(lm, call):
    """The token ids of the first forward pass of ``lm.model`` while ``call()`` runs."""
    return forward_inputs(lm, call)[0][0]


def test_complete_formatted_sends_exactly_the_prompt(lm):
    llm = TokRAGLLM(model=lm, max_new_tokens=4)
    prompt = "Some JSON for the selector:\n{"
    ids = _first_forward_ids(lm, lambda: llm.complete(prompt, formatted=True))
    assert ids == list(lm.tokenizer(prompt)["input_ids"])
    assert "Question:" not in lm.tokenizer.decode(ids)


def test_raw_prompt_path_formats_like_the_anchor(lm):
    """No passages: complete() sends the prompt as HuggingFaceLLM does (as given, behind the
    system prompt when unformatted); chat() uses the chat template; no QA wording."""
    tok = lm.tokenizer
    msgs = [{"role": "user", "content": "Say hi."}]
    llm = TokRAGLLM(model=lm, max_new_tokens=4)
    assert _first_forward_ids(lm, lambda: llm.complete("Say hi.")) == list(tok("Say hi.")["input_ids"])
    sys_complete = TokRAGLLM(model=lm, max_new_tokens=4, system_prompt="Be brief.")
    ids = _first_forward_ids(lm, lambda: sys_complete.complete("Say hi."))
    assert ids == list(tok("Be brief. Say hi.")["input_ids"])
    ids = _first_forward_ids(lm, lambda: sys_complete.complete("Say hi.", formatted=True))
    assert ids == list(tok("Say hi.")["input_ids"])

    sys_llm = TokRAGLLM(model=lm, max_new_tokens=4, system_prompt="Be brief.")
    chat = [ChatMessage(role="user", content="Say hi.")]
    ids = _first_forward_ids(lm, lambda: sys_llm.chat(chat))
    want = [{"role": "system", "content": "Be brief."}] + msgs
    assert ids == list(tok.apply_chat_template(want, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])

    hooked = TokRAGLLM(
        model=lm,
        max_new_tokens=4,
        completion_to_prompt=lambda p: f"<<{p}>>",
        messages_to_prompt=lambda ms: "|".join(m.content for m in ms),
    )
    assert _first_forward_ids(lm, lambda: hooked.complete("x")) == list(tok("<<x>>")["input_ids"])
    assert _first_forward_ids(lm, lambda: hooked.chat(chat)) == list(tok("Say hi.")["input_ids"])
