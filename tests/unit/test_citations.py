"""Citations (issue 46): the per-passage scores, the spans of Trace.citations(), their JSON and
their rendering, on hand-made traces (the packaged model: tests/integration/test_citations.py)."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from tokrag_integrations.attention.citations import citation_layers, passage_scores
from tokrag_integrations.trace import PassageRecord, Trace, TraceStep


def test_passage_scores_are_shares_of_the_passages_mass():
    attn = torch.zeros(2, 8)  # [H, T]
    attn[0, 1], attn[0, 5] = 0.2, 0.6  # head 0: 0.2 on passage 0, 0.6 on passage 1
    attn[1, 2], attn[1, 6] = 0.4, 0.0
    spans = [torch.tensor([1, 2]), torch.tensor([5, 6])]
    got = passage_scores(attn, spans)
    assert got == pytest.approx([0.5, 0.5])  # head means: 0.3 and 0.3
    layered = torch.stack([attn, torch.zeros(2, 8)])  # a second layer with no passage mass
    assert passage_scores(layered, spans) == pytest.approx([0.5, 0.5])
    assert passage_scores(torch.zeros(2, 8), spans) == pytest.approx([0.5, 0.5])
    assert passage_scores(attn, []) == []


def test_copy_vote_counts_the_heads_whose_argmax_holds_the_generated_token():
    attn = torch.zeros(3, 2, 8)  # [L, H, T]; passage 0 at 1-3, passage 1 at 5-7
    spans = [torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])]
    ids = [torch.tensor([10, 42, 11]), torch.tensor([12, 42, 13])]
    attn[..., 0] = 0.5  # every head leans on position 0, outside the passages ...
    attn[0, 0, 2] = attn[1, 0, 2] = 0.9  # ... but for three whose argmax copies 42
    attn[2, 1, 6] = 0.9
    attn[2, 0, 5] = 1.2  # this one lands on passage 1 at a token other than 42: no vote
    assert passage_scores(attn, spans, ids, 42) == pytest.approx([2 / 3, 1 / 3])
    # No head copies the token: the attention mass, as without the token.
    assert passage_scores(attn, spans, ids, 99) == pytest.approx(passage_scores(attn, spans))
    assert passage_scores(attn, spans) == pytest.approx([1.8 / 3.9, 2.1 / 3.9])  # the mass
    empty = [torch.tensor([], dtype=torch.long)] * 2
    assert passage_scores(attn, empty, empty, 42) == pytest.approx([0.5, 0.5])


def test_citation_layers():
    assert citation_layers(30, "last") == [29]
    assert citation_layers(30, "last4") == [26, 27, 28, 29]
    assert citation_layers(30, "upper") == list(range(15, 30))
    assert citation_layers(4, "all") == [0, 1, 2, 3]
    assert citation_layers(30, "upper-middle") == list(range(18, 24))  # SmolLM2: 19-24
    # A model of one or two layers (the architecture matrix's tiny models) still has one.
    assert [citation_layers(n, "upper-middle") for n in (1, 2, 3)] == [[0], [1], [1]]
    with pytest.raises(ValueError, match="unknown citation layers"):
        citation_layers(30, "middle")


def _trace(rows: list[tuple[str, list[float]]]) -> Trace:
    passages = [
        PassageRecord(rank=0, text="a", metadata={"source": "a.md"}),
        PassageRecord(rank=1, text="dropped", kept=False),
        PassageRecord(rank=2, text="b", metadata={"source": "b.md", "chunk": 3}),
    ]
    steps = [TraceStep(i, i, t, "agree", citation=c) for i, (t, c) in enumerate(rows)]
    return Trace(query="q", policy="tokrag", passages=passages, steps=steps)


def test_spans_are_runs_of_one_passage_split_at_sentence_ends():
    t = _trace(
        [
            ("It", [0.9, 0.1]),
            (" was", [0.8, 0.2]),
            (" Varga", [0.3, 0.7]),
            (".", [0.2, 0.8]),  # a sentence end splits the run of passage b
            (" She", [0.4, 0.6]),
            (" won", []),  # no citation here
        ]
    )
    spans = t.citations()
    assert [(c.text, c.passage, c.start, c.end) for c in spans] == [
        ("It was", 0, 0, 2),
        (" Varga.", 2, 2, 4),
        (" She", 2, 4, 5),
        (" won", None, 5, 6),
    ]
    assert spans[0].score == pytest.approx(0.85) and spans[0].source == "a.md"
    assert spans[1].metadata == {"source": "b.md", "chunk": 3}
    assert spans[3].score is None and spans[3].source is None
    # One span per sentence, cited by the shares summed over it.
    by_sentence = t.citations(by="sentence")
    assert [(c.text, c.passage) for c in by_sentence] == [
        ("It was Varga.", 0),  # 2.2 for a against 1.8 for b
        (" She", 2),
        (" won", None),
    ]
    assert t.cite(2, 4) == (2, pytest.approx(0.75))
    assert t.cite(5, 6) is None
    assert t.contributions() == [(0, pytest.approx(0.52)), (2, pytest.approx(0.48))]
    with pytest.raises(ValueError, match="'run' or 'sentence'"):
        t.citations(by="word")


def test_a_trace_without_citations():
    t = _trace([("Paris", []), (".", [])])
    assert [(c.text, c.passage) for c in t.citations()] == [("Paris.", None)]
    assert t.contributions() == []
    assert "Citations" not in t.to_html()


def test_citations_travel_in_the_json():
    t = _trace([("Var", [0.1, 0.9]), ("ga", [0.2, 0.8])])
    d = json.loads(t.to_json())
    assert d["steps"][0]["citation"] == [0.1, 0.9]
    assert d["citations"] == [
        {
            "start": 0,
            "end": 2,
            "text": "Varga",
            "passage": 2,
            "score": pytest.approx(0.85),
            "source": "b.md",
            "metadata": {"source": "b.md", "chunk": 3},
        }
    ]
    back = Trace.from_dict(d)
    assert back.steps[1].citation == [0.2, 0.8]
    assert back.citations() == t.citations()


def test_renderers_mark_each_span_with_its_passage():
    t = _trace([("It", [0.9, 0.1]), (" Varga", [0.3, 0.7]), (" won", [])])
    console = Console(record=True, width=120)
    t.render(console)
    text = console.export_text()
    assert "Cited: It[0] Varga[2] won" in text
    assert "carry no citation" in text
    page = t.to_html()
    assert "<h2>Citations</h2>" in page
    assert "<sup><b>[2]</b></sup>" in page and "b.md" in page
    assert "[0] 60 %, [2] 40 %" in page  # contributions, largest first
