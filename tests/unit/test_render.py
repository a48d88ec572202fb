"""Tests for the HTML and terminal renderers of a trace, on a hand-built trace."""

from __future__ import annotations

import html
import re
from html.parser import HTMLParser

import pytest
from rich.console import Console

from tokrag_integrations.render import format_value, render_trace, trace_to_html
from tokrag_integrations.trace import Candidate, PassageRecord, Trace, TraceStep


def _step(
    index: int,
    text: str,
    source: str,
    rag: tuple[int, str, float],
    pure: tuple[int, str, float],
    signals: dict | None = None,
) -> TraceStep:
    cands = {"rag": Candidate(*rag), "pure": Candidate(*pure)}
    chosen = cands["pure"] if source == "pure" else cands["rag"]
    return TraceStep(index, chosen.token_id, text, source, cands, signals or {})


@pytest.fixture
def trace() -> Trace:
    steps = [
        _step(0, "Ottoline", "agree", (11, "Ottoline", 0.91), (11, "Ottoline", 0.40)),
        _step(
            1,
            " Varga",
            "rag",
            (12, " Varga", 0.83),
            (99, " Smith", 0.08),
            {"l_star": 17, "cos_ir": 0.612345678, "cos_llm": 0.2, "fusion_jsd_layer": 21},
        ),
        _step(
            2,
            " <b>&",
            "pure",
            (13, " the", 0.31),
            (14, " <b>&", 0.44),
            {"l_star": 16, "cos_ir": 0.21, "cos_llm": 0.443321},
        ),
        _step(3, "\nend", "agree", (15, "\nend", 0.9), (15, "\nend", 0.8)),
        _step(4, "©", "mix", (16, "©", 0.5), (17, "®", 0.4), {"alpha": 0.5}),
        _step(5, ".", "passage:0", (18, ".", 0.9), (18, ".", 0.9)),
    ]
    return Trace(
        query="Who founded <Quillfeather> & when?",
        policy="tokrag",
        model="SmolLM2-135M-Instruct",
        options={"pr_norm": "softmax"},
        passages=[
            PassageRecord(0, "Founded by Ottoline Varga <i>in 2009</i>.", 0.7961, 12),
            PassageRecord(1, "Code name Bramblewick.", 0.5, 7, kept=True, cut=True),
            PassageRecord(2, "Leave is booked in Ledger.", None, 0, kept=False),
        ],
        warnings=["Passage 2 was dropped <too long>."],
        steps=steps,
        text="".join(s.text for s in steps),
        stop_reason="eos",
    )


class _TokenCollector(HTMLParser):
    """Collects each answer token span: its classes, its visible text and its tooltip text."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[dict[str, str]] = []
        self._depth = 0  # span depth inside the current token, 0 = outside a token
        self._in_tip = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        cls = a.get("class") or ""
        if tag == "span" and self._depth == 0 and cls.split()[:1] == ["tok"]:
            self.tokens.append({"class": cls, "text": "", "tip": "", "source": a["data-source"]})
            self._depth = 1
        elif self._depth:
            if tag == "span":
                self._depth += 1
            if "tip" in cls.split():
                self._in_tip = True

    def handle_endtag(self, tag: str) -> None:
        if self._depth and tag == "span":
            self._depth -= 1
            if self._depth == 1:
                self._in_tip = False

    def handle_data(self, data: str) -> None:
        if self._depth:
            self.tokens[-1]["tip" if self._in_tip else "text"] += data


def _tokens(page: str) -> list[dict[str, str]]:
    parser = _TokenCollector()
    parser.feed(page)
    return parser.tokens


def test_html_is_standalone(trace: Trace) -> None:
    page = trace_to_html(trace)
    assert page.startswith("<!DOCTYPE html>")
    assert "<style>" in page
    # nothing is loaded from elsewhere
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "<link" not in page


def test_html_escapes_every_trace_string(trace: Trace) -> None:
    page = trace_to_html(trace)
    assert "<Quillfeather>" not in page
    assert html.escape("Who founded <Quillfeather> & when?") in page
    assert "<b>&" not in page  # the token text
    assert "<i>in 2009</i>" not in page  # passage text
    assert "<too long>" not in page  # warning
    assert "&lt;too long&gt;" in page


def test_html_token_spans_coloured_by_source(trace: Trace) -> None:
    tokens = _tokens(trace_to_html(trace))
    assert [t["source"] for t in tokens] == ["agree", "rag", "pure", "agree", "mix", "passage:0"]
    classes = [t["class"].split()[1] for t in tokens]
    assert classes == ["src-agree", "src-rag", "src-pure", "src-agree", "src-other", "src-other"]
    # disagreement steps are marked, agreement steps are not
    assert ["dis" in t["class"].split() for t in tokens] == [
        False, True, True, False, True, False,
    ]  # fmt: skip
    # the parsed (unescaped) token text is the original; the newline is shown as a mark
    assert tokens[2]["text"] == " <b>&"
    assert tokens[3]["text"] == "↵\nend"


def test_html_colours_and_legend(trace: Trace) -> None:
    page = trace_to_html(trace)
    css = page[page.index("<style>") : page.index("</style>")]
    for cls in ("src-agree", "src-rag", "src-pure", "src-other"):
        assert f".tok.{cls}" in css
    assert "from retrieval" in page and "from the model" in page
    assert re.search(r'class="legend".*passage:0', page)


def test_html_tooltip_shows_candidates_and_signals(trace: Trace) -> None:
    tip = _tokens(trace_to_html(trace))[1]["tip"]
    assert "RAG context" in tip and "pure context" in tip
    assert "␣Varga" in tip and "p=0.8300" in tip
    assert "␣Smith" in tip and "p=0.0800" in tip
    assert "l_star" in tip and "17" in tip
    assert "cos_ir" in tip and "0.6123" in tip and "0.612345" not in tip
    assert "cos_llm" in tip and "0.2000" in tip
    assert "fusion_jsd_layer" in tip
    # signal order: l_star, cos_ir, cos_llm first
    assert tip.index("l_star") < tip.index("cos_ir") < tip.index("cos_llm")
    # escaping inside the tooltip
    assert "␣<b>&" in _tokens(trace_to_html(trace))[2]["tip"]


def test_html_summary_passages_and_disagreements(trace: Trace) -> None:
    page = trace_to_html(trace)
    text = re.sub(r"<[^>]+>", " ", page)
    assert "tokrag" in text and "SmolLM2-135M-Instruct" in text and "eos" in text
    assert re.search(r"agree\s+2\b", text) and re.search(r"rag\s+1\b", text)
    # passages: rank, score, status, token count
    for status in ("kept", "cut", "dropped"):
        assert f'class="badge {status}"' in page
    assert "0.7961" in page
    # one table row per disagreement step
    rows = re.findall(r'<tr id="step-(\d+)">', page)
    assert rows == ["1", "2", "4"]
    assert "Disagreement steps (3)" in page


def test_html_handles_empty_trace() -> None:
    page = trace_to_html(Trace(query="q?", policy="no_rag", text="plain"))
    assert "plain" in page
    assert "No passages" in page
    assert "agreed on every token" in page


def test_format_value() -> None:
    assert format_value(0.123456) == "0.1235"
    assert format_value(3) == "3"
    assert format_value(None) == "—"
    assert format_value([0.5, 2]) == "[0.5000, 2]"
    assert format_value(True) == "True"
    assert format_value({"packed_head": "measured slower", "n": 0.5}) == "{packed_head: measured slower, n: 0.5000}"


def test_rich_render(trace: Trace) -> None:
    console = Console(record=True, width=140, color_system="truecolor")
    render_trace(trace, console=console)
    out = console.export_text(clear=False)
    assert "Who founded <Quillfeather> & when?" in out
    assert "Ottoline Varga <b>&" in out  # the answer, token by token (no markup parsing)
    assert "Disagreement steps (3)" in out
    for header in ("step", "rag candidate", "pure candidate", "chosen", "l*", "cos_ir", "cos_llm"):
        assert header in out
    assert "␣Varga (0.8300)" in out and "␣Smith (0.0800)" in out
    assert "0.6123" in out and "0.4433" in out
    assert "warning: Passage 2 was dropped <too long>." in out
    assert "from retrieval" in out and "from the model" in out
    # tokens carry their colours: rag green, llm blue
    styled = console.export_text(styles=True)
    assert re.search(r"\x1b\[[0-9;]*32m Varga", styled)
    assert re.search(r"\x1b\[[0-9;]*34m <b>&", styled)


def test_trace_methods_use_renderers(trace: Trace, tmp_path) -> None:
    path = tmp_path / "t.html"
    page = trace.to_html(path)
    assert path.read_text(encoding="utf-8") == page
    console = Console(record=True, width=120)
    trace.render(console)
    assert "Disagreement steps" in console.export_text()


def _css_rule(page: str, selector: str) -> dict[str, str]:
    """The declarations of the page's CSS rule for exactly ``selector``."""
    css = re.search(r"<style>(.*?)</style>", page, flags=re.S).group(1)
    for selectors, body in re.findall(r"([^{}]+)\{([^}]*)\}", css):
        if selector in [s.strip() for s in selectors.split(",")]:
            pairs = (d.split(":", 1) for d in body.split(";") if ":" in d)
            return {k.strip(): v.strip() for k, v in pairs}
    raise AssertionError(f"no CSS rule for {selector}")


def test_html_tooltip_labels_never_break_inside_a_word(trace: Trace) -> None:
    page = trace_to_html(trace)
    # the answer breaks long tokens anywhere; its tooltip must not inherit that
    assert _css_rule(page, ".answer")["overflow-wrap"] == "anywhere"
    tip = _css_rule(page, ".tok .tip")
    assert tip["overflow-wrap"] == "normal" and tip["word-break"] == "normal"
    assert _css_rule(page, ".tip td.k")["white-space"] == "nowrap"  # "cos_llm", "benefit"
    assert '<td class="k">cos_llm</td>' in page


def test_html_timings_show_flags_as_on_off_and_counts_as_integers(trace: Trace) -> None:
    trace.timings = {
        "prefill_s": 3.2405,
        "fused": 1.0,
        "packed": 0.0,
        "queries_in_batch": 1.0,
        "drafted": 12.0,
    }
    page = trace_to_html(trace)
    card = re.search(r'<div class="k">Timings</div><div class="v">(.*?)</div>', page, re.S)[1]
    assert card.splitlines() == [
        "prefill_s 3.2405",
        "fused on",
        "packed off",
        "queries_in_batch 1",
        "drafted 12",
    ]


def test_html_shows_the_rule_options_apart_from_the_speed(trace: Trace) -> None:
    """The rule's options on one line, the call's speed and the paths that were off on the
    next: a speed path measured off is not an option of the rule."""
    trace.speed = {"fuse": True, "speed_paths_off": {"packed_head": "measured slower"}}
    page = trace_to_html(trace)
    lines = re.findall(r'font-size:13px">((?:Options|Speed): [^<]*)</p>', page)
    assert lines == [
        "Options: pr_norm=softmax",
        "Speed: fuse=True, speed_paths_off={packed_head: measured slower}",
    ]


def test_comparable_leaves_out_what_the_machine_measured(trace: Trace) -> None:
    """Two traces of one decode that differ only in their timings and speed are comparable-equal;
    one that differs in an option, a token's source or a signal is not."""
    from tokrag_integrations.trace import comparable

    first = Trace.from_dict(trace.to_dict())
    later = Trace.from_dict(trace.to_dict())
    first.timings, first.speed = {"decode_s": 1.0}, {"fuse": True, "speed_paths_off": {}}
    later.timings = {"decode_s": 2.0, "fused": 0.0}
    later.speed = {"fuse": False, "speed_paths_off": {"packed_head": "measured slower"}}
    assert first.to_dict() != later.to_dict() and first.comparable() == later.comparable()
    assert comparable(later.to_dict()) == later.comparable()
    assert set(trace.to_dict()) - set(trace.comparable()) == {"timings", "speed"}
    for change in (
        lambda t: t.options.update(threshold=0.2),
        lambda t: setattr(t.steps[1], "source", "pure"),
        lambda t: t.steps[1].signals.update(cos_ir=0.7),
    ):
        other = Trace.from_dict(trace.to_dict())
        change(other)
        assert other.comparable() != first.comparable()


def test_html_disagreement_table_scrolls_and_wraps_inside_its_card(trace: Trace) -> None:
    trace.steps[1].signals.update(
        fusion_attn_layer=20, p_r_top=[[" Varga", 0.6123], [" Otto", 0.2], [" founded", 0.1]]
    )
    page = trace_to_html(trace)
    section = page[page.index("Disagreement steps (3)") :]
    assert section.index('<div class="scroll"><table class="data">') < section.index("<thead>")
    assert _css_rule(page, ".scroll")["overflow-x"] == "auto"
    # long header names may break after an underscore only; lists wrap in their cell
    assert "<th>fusion_<wbr>attn_<wbr>layer</th>" in section
    assert '<td class="txt">[[ Varga, 0.6123], [ Otto, 0.2000], [ founded, 0.1000]]</td>' in section
    assert _css_rule(page, "table.data td.txt")["white-space"] == "normal"
    assert '<td class="num">0.6123</td>' in section  # numbers stay right-aligned on one line


def test_cut_answer_says_so() -> None:
    page = trace_to_html(Trace(query="q?", policy="rag", text="cut", stop_reason="length"))
    assert "length (cut at max_new_tokens)" in page


def test_trace_to_dict_is_json_data_without_a_default(trace: Trace) -> None:
    import json

    import numpy as np
    import torch

    trace.steps[1].signals.update(
        {
            "tensor": torch.tensor([0.5, 0.25]),
            "scalar": torch.tensor(3),
            "np": np.float32(0.5),
            "np_int": np.int64(7),
            "array": np.arange(3),
            "pair": (1, 2),
            "roles": {"rag"},
            "by_layer": {3: 0.1, 4: 0.2},
        }
    )
    d = trace.to_dict()
    text = json.dumps(d)  # no default=
    assert json.loads(text) == d
    signals = d["steps"][1]["signals"]
    assert signals["tensor"] == [0.5, 0.25] and signals["scalar"] == 3
    assert signals["np"] == 0.5 and signals["np_int"] == 7 and signals["array"] == [0, 1, 2]
    assert signals["pair"] == [1, 2] and signals["roles"] == ["rag"]
    assert signals["by_layer"] == {"3": 0.1, "4": 0.2}
    assert trace.to_json(indent=None) == json.dumps(d, indent=None, ensure_ascii=False)
    again = Trace.from_dict(d)
    assert again.to_dict() == d and again.counts() == trace.counts()


def test_rich_render_shows_the_margin_and_the_threshold_that_allowed_it(trace: Trace) -> None:
    """A RAG token kept with cos_ir < cos_llm reads as a contradiction unless the table says
    the rule compares their difference with a (default −0.1) threshold."""
    trace.options = {"threshold": -0.1, "scorer": "cosine"}
    trace.steps[1].signals = {"l_star": 18, "cos_ir": 0.5943, "cos_llm": 0.6419}  # rag kept
    console = Console(record=True, width=200)
    render_trace(trace, console=console)
    out = console.export_text()
    assert "cos_ir − cos_llm ≥ threshold -0.1000" in out
    row = next(line for line in out.splitlines() if "␣Varga (rag)" in line)
    assert row.split("│")[-2].strip() == "-0.0476"  # the margin column: above the threshold
    # Without a threshold in the options (another policy), no margin column, no claim.
    trace.options = {"pr_norm": "softmax"}
    console = Console(record=True, width=200)
    render_trace(trace, console=console)
    assert "margin" not in console.export_text()


def test_trace_json_is_version_2_and_version_1_reads_with_todays_names(trace: Trace) -> None:
    """Version 2 (issue 55: one word for one thing) writes the pure context's token source
    ``pure`` and the policy names ``no_rag`` / ``tokrag_authors``; a dict with no ``version``
    is version 1, whose ``llm`` source and ``llm`` / ``tokrag_reference`` policies read as
    today's names. A version this library does not know is refused, naming the field."""
    d = trace.to_dict()
    assert d["version"] == 2 and Trace.from_dict(d).to_dict() == d
    old = {k: v for k, v in d.items() if k != "version"}
    old["steps"] = [{**s, "source": "llm" if s["source"] == "pure" else s["source"]} for s in d["steps"]]
    assert [s["source"] for s in old["steps"]][:3] == ["agree", "rag", "llm"]
    for was, now in (("llm", "no_rag"), ("tokrag_reference", "tokrag_authors"), ("tokrag", "tokrag")):
        back = Trace.from_dict({**old, "policy": was})
        assert back.policy == now
        assert [s.source for s in back.steps] == [s.source for s in trace.steps]
        assert back.counts() == trace.counts() and back.counts()["pure"] == 1
    # In version 2 the names are read as written (a rule's own label stays its own).
    v2 = Trace.from_dict({**d, "policy": "llm", "steps": old["steps"]})
    assert v2.policy == "llm" and v2.steps[2].source == "llm"
    with pytest.raises(ValueError, match=r"trace\.version is 3: this library reads versions 1 and 2"):
        Trace.from_dict({**d, "version": 3})
    with pytest.raises(ValueError, match=r"trace\.version is a str, not a int"):
        Trace.from_dict({**d, "version": "2"})
