"""TokRAGSynthesizer's response modes, metadata_mode and LlamaIndex callback events.

Every answer comes from the real packaged model (SmolLM2-135M-Instruct, the shared ``lm``
fixture of conftest.py). Answers are a few tokens and the windows are made small with
``max_context_tokens`` so that the multi-call modes need only a handful of short decodes.
"""

from __future__ import annotations

import json
import warnings

import pytest
from _helpers import require

require("llama_index.core", "llama-index-core")

import llama_index.core.instrumentation as instrument  # noqa: E402
from llama_index.core import Settings  # noqa: E402
from llama_index.core.base.response.schema import (  # noqa: E402
    AsyncStreamingResponse,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import Field  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.response_synthesizers import ResponseMode  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402

from tokrag_integrations.llama_index import TokRAGSynthesizer  # noqa: E402

CAT_Q = "What is the name of the Harrowgate office cat?"
CAT_FACT = "The Harrowgate office cat is called Pumpernickel."
CAT = "Pumpernickel"
_TOPICS = ["canteen", "parking", "printer", "library", "gym", "garden", "lift", "badge", "mail room"]


def _node(text, node_id, score=None, **metadata):
    return NodeWithScore(node=TextNode(text=text, id_=node_id, metadata=metadata), score=score)


def _filler(i):
    return (
        f"Note {i}: the Harrowgate office {_TOPICS[i % len(_TOPICS)]} is open from "
        f"{7 + i % 5} am on weekdays and closed on public holidays."
    )


@pytest.fixture(scope="module")
def thirty_nodes():
    """29 unrelated notes, best scored first, and the fact last with the lowest score."""
    nodes = [_node(_filler(i), f"n{i}", 1.0 - i * 0.01) for i in range(29)]
    return nodes + [_node(CAT_FACT, "fact", 0.1)]


@pytest.fixture(scope="module")
def four_nodes():
    return [
        _node("The Harrowgate office opened in 2012 next to the old tram depot.", "a", 0.9),
        _node(CAT_FACT, "b", 0.8),
        _node("The cat sleeps on the radiator by the reception desk.", "c", 0.7),
        _node(_filler(1), "d", 0.6),
    ]


def _counting(lm):
    handler = TokenCountingHandler(tokenizer=lm.tokenizer.encode)
    return handler, CallbackManager([handler])


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


def _check_calls(md, n_nodes):
    """Per-call metadata is complete and adds up to the totals."""
    calls = md["calls"]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    for c in calls:
        assert c["trace"]["text"] == c["text"]
        assert c["usage"]["completion_tokens"] == len(c["trace"]["steps"]) > 0
        assert c["usage"]["prompt_tokens"] > 0
    assert md["trace"] is calls[-1]["trace"]
    assert md["usage"]["prompt_tokens"] == sum(c["usage"]["prompt_tokens"] for c in calls)
    assert md["usage"]["calls"] == len(calls)
    assert len(md["passages"]) == n_nodes
    assert json.loads(json.dumps(md)) == md


# ----------------------------------------------------------------------------- (a) callbacks
def test_token_counting_handler_counts_every_call(lm, events):
    handler, cm = _counting(lm)
    synth = TokRAGSynthesizer(lm, max_new_tokens=4, callback_manager=cm)  # tokrag
    r = synth.synthesize(CAT_Q, [_node(CAT_FACT, "a", 0.9)])
    tr, usage = r.metadata["trace"], r.metadata["usage"]
    assert len(handler.llm_token_counts) == 1
    # tokrag prefills both contexts: both count as prompt tokens (as ChatTokRAG's usage).
    assert handler.prompt_llm_token_count == usage["prompt_tokens"] > 0
    assert usage["prompt_tokens"] == tr["prompt_tokens"]["pure"] + tr["prompt_tokens"]["rag"]
    assert handler.completion_llm_token_count == len(tr["steps"]) == 4
    # The prompt in the payload is the RAG prompt the model read, passage included.
    event = handler.llm_token_counts[0]
    assert CAT_FACT in event.prompt and CAT_Q in event.prompt
    assert event.completion == r.response
    names = [e.class_name() for e in events]
    assert names.count("LLMCompletionStartEvent") == names.count("LLMCompletionEndEvent") == 1

    # Settings.callback_manager is the fallback; each call of a multi-call mode counts.
    handler2, cm2 = _counting(lm)
    old = Settings._callback_manager
    Settings.callback_manager = cm2
    try:
        synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=2, response_mode="refine")
    finally:
        Settings._callback_manager = old
    r = synth.synthesize(CAT_Q, [_node(CAT_FACT, "a", 0.9), _node(_filler(2), "b", 0.5)])
    assert len(handler2.llm_token_counts) == len(r.metadata["calls"]) == 2
    assert handler2.prompt_llm_token_count == r.metadata["usage"]["prompt_tokens"]
    assert handler2.completion_llm_token_count == r.metadata["usage"]["completion_tokens"] == 4


# ----------------------------------------------------------------------------- (b) compact
def test_compact_finds_the_fact_one_pass_dropped(lm, thirty_nodes):
    kw = {"max_new_tokens": 12, "max_context_tokens": 320}  # default policy: tokrag
    with pytest.warns(UserWarning, match="do not fit"):
        one = TokRAGSynthesizer(lm, **kw).synthesize(CAT_Q, thirty_nodes)
    md = one.metadata
    assert md["response_mode"] == "one_pass" and len(md["calls"]) == 1
    assert CAT not in one.response
    assert "fact" in md["nodes_dropped"] and md["n_nodes_dropped"] == len(md["nodes_dropped"]) > 10
    assert next(p for p in md["passages"] if p["node_id"] == "fact")["kept"] is False

    handler, cm = _counting(lm)
    synth = TokRAGSynthesizer(lm, response_mode="compact", callback_manager=cm, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every chunk fits: nothing is cut or dropped
        r = synth.synthesize(CAT_Q, thirty_nodes)
    md = r.metadata
    assert CAT in r.response
    assert md["response_mode"] == "compact" and md["answered_from"] == "retrieval"
    assert md["nodes_dropped"] == [] and md["n_nodes_dropped"] == 0 and md["nodes_cut"] == []
    calls = md["calls"]
    assert 2 < len(calls) < 30  # packed several nodes per call
    assert [c["kind"] for c in calls] == ["answer"] + ["refine"] * (len(calls) - 1)
    assert all(c["answers_from"] == [c["index"] - 1] for c in calls[1:])
    assert [n for c in calls for n in c["node_ids"]] == [n.node.node_id for n in thirty_nodes]
    assert "fact" in calls[-1]["node_ids"]
    for c in calls:  # every chunk filled to fit the same window as the one-pass prompt
        assert c["nodes_dropped"] == [] and c["nodes_cut"] == []
        assert c["trace"]["prompt_tokens"]["rag"] <= 320 - 12
    _check_calls(md, 30)
    assert len(handler.llm_token_counts) == len(calls)
    assert handler.prompt_llm_token_count == md["usage"]["prompt_tokens"]


# ----------------------------------------------------------------------------- (c) bad mode
def test_unknown_response_mode_lists_the_accepted_ones(lm):
    for bad in ("summarise", ResponseMode.GENERATION, None):
        with pytest.raises(ValueError, match="'one_pass', 'compact', 'refine', 'tree_summarize'"):
            TokRAGSynthesizer(lm, response_mode=bad)
    assert TokRAGSynthesizer(lm, response_mode=ResponseMode.COMPACT).response_mode == "compact"
    simple = TokRAGSynthesizer(lm, response_mode=ResponseMode.SIMPLE_SUMMARIZE)
    assert simple.response_mode == "simple_summarize" and simple.uses_templates
    assert TokRAGSynthesizer(lm).response_mode == "one_pass"
    with pytest.raises(ValueError, match="metadata_mode"):
        TokRAGSynthesizer(lm, metadata_mode="everything")
    with pytest.raises(ValueError, match="max_context_tokens"):
        TokRAGSynthesizer(lm, max_context_tokens=0)


# ----------------------------------------------------------------------------- (d) metadata
def test_metadata_mode_puts_node_metadata_in_the_prompt(lm):
    node = _node(
        "The memo asks everyone to feed the office cat before nine.",
        "memo",
        0.9,
        author="Ysolde Karamanlis",
        file_path="/secret/memo.txt",
    )
    node.node.excluded_llm_metadata_keys = ["file_path"]
    handler, cm = _counting(lm)
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=8, callback_manager=cm)
    assert synth.metadata_mode == MetadataMode.LLM
    r = synth.synthesize("Who is the author of the memo?", [node])
    prompt = handler.llm_token_counts[0].prompt
    assert "author: Ysolde Karamanlis" in prompt and "/secret/" not in prompt
    assert r.metadata["trace"]["passages"][0]["text"] == node.node.get_content(MetadataMode.LLM)
    assert "Ysolde" in r.response  # the model read it

    handler, cm = _counting(lm)
    plain = TokRAGSynthesizer(
        lm, policy="rag", max_new_tokens=1, callback_manager=cm, metadata_mode=MetadataMode.NONE
    )
    plain.synthesize("Who is the author of the memo?", [node])
    assert "Karamanlis" not in handler.llm_token_counts[0].prompt


# ----------------------------------------------------------------------------- (e) refine/tree
def test_refine_one_call_per_node(lm, four_nodes):
    synth = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=6, response_mode="refine")
    r = synth.synthesize(CAT_Q, four_nodes)
    md = r.metadata
    assert r.response.strip() and r.response == md["calls"][-1]["text"]
    assert [c["node_ids"] for c in md["calls"]] == [["a"], ["b"], ["c"], ["d"]]
    assert [c["kind"] for c in md["calls"]] == ["answer", "refine", "refine", "refine"]
    # from the second call on, the first passage is the answer so far
    second = md["calls"][1]["trace"]["passages"]
    assert second[0]["text"] == "Existing answer: " + md["calls"][0]["text"].strip()
    assert second[1]["metadata"]["node_id"] == "b"
    assert md["nodes_used"] == ["a", "b", "c", "d"]
    assert all(p["calls"] == [i] for i, p in enumerate(md["passages"]))
    _check_calls(md, 4)


def test_tree_summarize_answers_chunks_then_combines(lm, four_nodes):
    synth = TokRAGSynthesizer(
        lm, policy="rag", max_new_tokens=6, max_context_tokens=120, response_mode="tree_summarize"
    )
    r = synth.synthesize(CAT_Q, four_nodes)
    md = r.metadata
    calls = md["calls"]
    leaves = [c for c in calls if c["kind"] == "summarize"]
    assert len(leaves) >= 2 and all(c["level"] == 0 for c in leaves)
    assert [n for c in leaves for n in c["node_ids"]] == ["a", "b", "c", "d"]
    last = calls[-1]
    assert last["kind"] == "combine" and last["level"] >= 1 and last["node_ids"] == []
    assert last["answers_from"] and r.response == last["text"] and r.response.strip()
    # the combining call read the earlier answers as its passages
    texts = [p["text"] for p in last["trace"]["passages"]]
    assert texts == [calls[i]["text"].strip() for i in last["answers_from"]]
    assert md["nodes_dropped"] == [] and md["answered_from"] == "retrieval"
    _check_calls(md, 4)


# ----------------------------------------------------------------------------- stream/async
async def test_compact_streaming_and_async_match(lm, four_nodes):
    kw = {"policy": "rag", "max_new_tokens": 6, "max_context_tokens": 120, "response_mode": "compact"}
    ref = TokRAGSynthesizer(lm, **kw).synthesize(CAT_Q, four_nodes)
    assert len(ref.metadata["calls"]) >= 2

    handler, cm = _counting(lm)
    rs = TokRAGSynthesizer(lm, streaming=True, callback_manager=cm, **kw).synthesize(
        CAT_Q, four_nodes
    )
    assert isinstance(rs, StreamingResponse) and "calls" not in rs.metadata
    assert "".join(rs.response_gen) == ref.response
    assert [c["text"] for c in rs.metadata["calls"]] == [c["text"] for c in ref.metadata["calls"]]
    assert len(handler.llm_token_counts) == len(ref.metadata["calls"])  # the streamed one too

    ra = await TokRAGSynthesizer(lm, **kw).asynthesize(CAT_Q, four_nodes)
    assert ra.response == ref.response and ra.metadata["counts"] == ref.metadata["counts"]

    ras = await TokRAGSynthesizer(lm, streaming=True, **kw).asynthesize(CAT_Q, four_nodes)
    assert isinstance(ras, AsyncStreamingResponse)
    assert "".join([c async for c in ras.async_response_gen()]) == ref.response
    assert ras.metadata["usage"] == ref.metadata["usage"]

    # get_response over plain text chunks takes the same mode
    chunks = [n.node.get_content() for n in four_nodes]
    assert TokRAGSynthesizer(lm, **kw).get_response(CAT_Q, chunks) == ref.response


# ----------------------------------------------------------------------------- edge cases
def test_long_node_is_split_empty_skipped_gate_no_is_one_call(lm):
    long = "The Kestrel-7 programme tested thrusters at the Dundee site every week. " * 10
    nodes = [_node(long, "long", 0.9), _node("  ", "blank", 0.5), _node(CAT_FACT, "cat", 0.4)]
    synth = TokRAGSynthesizer(
        lm, policy="rag", max_new_tokens=2, max_context_tokens=140, response_mode="compact"
    )
    with pytest.warns(UserWarning, match="empty"):
        r = synth.synthesize(CAT_Q, nodes)
    md = r.metadata
    long_rec = md["passages"][0]
    assert long_rec["parts"] >= 2 and not long_rec["cut"]  # split over calls, nothing lost
    parts = [
        p["text"] for c in md["calls"] for p in c["trace"]["passages"]
        if p["metadata"].get("node_id") == "long"
    ]
    assert "".join(parts).split() == long.split()
    assert md["nodes_skipped_empty"] == ["blank"] and md["nodes_dropped"] == []
    assert md["nodes_used"] == ["long", "cat"] and md["nodes_cut"] == []

    class No:
        def decide(self, query):
            return type("D", (), {"retrieve": False, "score": 0.1, "to_dict": lambda s: {}})()

    for mode in ("compact", "tree_summarize"):
        r = TokRAGSynthesizer(lm, max_new_tokens=2, response_mode=mode, gate=No()).synthesize(
            CAT_Q, nodes
        )
        assert len(r.metadata["calls"]) == 1 and r.metadata["answered_from"] == "pure_context"
        assert r.metadata["pure_context_reason"] == "the gate decided not to use retrieval"

    # tree_summarize whose nodes fit one chunk: a single call, like one pass
    r = TokRAGSynthesizer(lm, policy="rag", max_new_tokens=2, response_mode="tree_summarize")
    md = r.synthesize(CAT_Q, nodes[2:]).metadata
    assert [(c["kind"], c["level"]) for c in md["calls"]] == [("summarize", 0)]
