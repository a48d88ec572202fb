"""Renderers for :class:`~tokrag_integrations.trace.Trace`: a standalone HTML page and a
terminal view (rich).

Both colour every generated token by its source: ``agree`` (both contexts chose it) is
neutral grey, ``rag`` (taken from the retrieval-augmented context) green, ``llm`` (taken from
the model's own, passage-free context) blue; any other label a policy uses (``mix``,
``passage:0``...) is amber. Hovering a token in the HTML page shows each context's top-1
candidate with its probability and the signals behind the decision (Tok-RAG paper, Fig. 5).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .labels import AGREE, FROM_LLM, FROM_RAG

if TYPE_CHECKING:  # pragma: no cover - typing only (trace.py imports this module lazily)
    from rich.console import Console

    from .trace import Candidate, PassageRecord, Trace, TraceStep

__all__ = ["trace_to_html", "render_trace", "source_label", "format_value", "format_timing"]

#: Human-readable meaning of the two-context source labels.
_SOURCE_LABELS: dict[str, str] = {
    AGREE: "both contexts agree",
    FROM_RAG: "from retrieval",
    FROM_LLM: "from the model",
}
#: Display names of the context roles found in ``TraceStep.candidates``.
_ROLE_LABELS: dict[str, str] = {"rag": "RAG context", "pure": "LLM context", "llm": "LLM context"}
#: Signals shown first (in this order) wherever signals are listed; others follow sorted.
_SIGNAL_ORDER = ("l_star", "cos_ir", "cos_llm", "fusion_attn_layer", "fusion_jsd_layer")
#: Terminal styles per source; unknown labels get ``_RICH_OTHER``.
_RICH_STYLES: dict[str, str] = {AGREE: "", FROM_RAG: "bold green", FROM_LLM: "bold blue"}
_RICH_OTHER = "bold dark_orange"


# ============================================================================ helpers
def source_label(source: str) -> str:
    """What a source label means, for legends and tooltips (unknown labels as they are)."""
    return _SOURCE_LABELS.get(source, source)


def _source_class(source: str) -> str:
    """CSS class for a source: one per known label, one shared neutral-amber class otherwise."""
    return f"src-{source}" if source in _SOURCE_LABELS else "src-other"


def format_value(value: Any) -> str:
    """A signal or score as short text: floats with 4 digits, sequences element-wise."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        # Tiny thresholds (e.g. jsd_threshold 5e-7) would print as 0.0000.
        return f"{value:.2e}" if value != 0 and abs(value) < 1e-3 else f"{value:.4f}"
    if isinstance(value, int):
        return str(value)
    if hasattr(value, "tolist"):  # torch / numpy scalars and arrays
        return format_value(value.tolist())
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


#: Timing entries that are on/off flags (stored as 0.0 / 1.0 floats).
_TIMING_FLAGS = frozenset({"fused", "packed"})


def format_timing(key: str, value: Any) -> str:
    """One ``Trace.timings`` entry as text: seconds (``*_s``) with 4 digits, flags as
    ``on``/``off``, counts (whole numbers) as integers."""
    if isinstance(value, bool) or (key in _TIMING_FLAGS and value in (0, 1)):
        return "on" if value else "off"
    if key.endswith("_s") or not isinstance(value, (int, float)):
        return format_value(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format_value(value)


def _visible(text: str) -> str:
    """Token text with whitespace made visible, for tables (one line, no escaping)."""
    if text == "":
        return "∅"
    out = text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return "".join(c if c >= " " or c in "↵⇥" else f"\\x{ord(c):02x}" for c in out)


def _ordered_signals(signals: Mapping[str, Any]) -> list[tuple[str, Any]]:
    known = [(k, signals[k]) for k in _SIGNAL_ORDER if k in signals]
    rest = sorted((k, v) for k, v in signals.items() if k not in _SIGNAL_ORDER)
    return known + rest


def _signal_keys(steps: Iterable[TraceStep]) -> list[str]:
    keys: set[str] = set()
    for s in steps:
        keys.update(s.signals)
    return [k for k in _SIGNAL_ORDER if k in keys] + sorted(keys - set(_SIGNAL_ORDER))


def _roles(steps: Iterable[TraceStep]) -> list[str]:
    """Candidate roles in a stable order: rag, pure/llm, then the rest as first seen."""
    seen: list[str] = []
    for s in steps:
        for role in s.candidates:
            if role not in seen:
                seen.append(role)
    first = [r for r in ("rag", "pure", "llm") if r in seen]
    return first + [r for r in seen if r not in first]


def _passage_status(p: PassageRecord) -> str:
    if not p.kept:
        return "dropped"
    return "cut" if p.cut else "kept"


def _passage_source(p: PassageRecord) -> str:
    md = p.metadata or {}
    for key in ("source", "file_name", "file_path", "url", "id"):
        if md.get(key) not in (None, ""):
            return str(md[key])
    return ""


# ============================================================================ HTML
_CSS = """
:root {
  --fg: #1f2937; --muted: #6b7280; --line: #e5e7eb; --bg: #f6f7f9; --card: #ffffff;
  --agree-bg: #eceff3; --agree-bd: #c3c9d2;
  --rag-bg: #dcf5e3; --rag-bd: #16a34a; --rag-fg: #14532d;
  --llm-bg: #dde9fd; --llm-bd: #2563eb; --llm-fg: #1e3a8a;
  --other-bg: #fdf0d2; --other-bd: #d97706; --other-fg: #78350f;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 15px/1.5 -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue",
  Arial, sans-serif; }
main { max-width: 1000px; margin: 0 auto; padding: 28px 24px 48px; }
header.top { display: flex; align-items: baseline; justify-content: space-between;
  gap: 16px; margin-bottom: 18px; }
header.top h1 { font-size: 20px; margin: 0; letter-spacing: -0.01em; }
header.top .meta { color: var(--muted); font-size: 13px; }
section.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px;
  padding: 18px 22px; margin-bottom: 16px; box-shadow: 0 1px 2px rgba(16, 24, 40, 0.04); }
h2 { font-size: 12px; text-transform: uppercase; letter-spacing: 0.06em; color: var(--muted);
  margin: 0 0 10px; font-weight: 600; }
.question { font-size: 18px; font-weight: 600; white-space: pre-wrap; overflow-wrap: anywhere; }
.answer { font-size: 17px; line-height: 2.1; white-space: pre-wrap; overflow-wrap: anywhere; }
.tok { position: relative; border-radius: 3px; padding: 2px 0; cursor: help;
  border-bottom: 2px solid transparent; outline: none; }
.tok.src-agree { background: var(--agree-bg); }
.tok.src-rag { background: var(--rag-bg); border-bottom-color: var(--rag-bd); color: var(--rag-fg); }
.tok.src-llm { background: var(--llm-bg); border-bottom-color: var(--llm-bd); color: var(--llm-fg); }
.tok.src-other { background: var(--other-bg); border-bottom-color: var(--other-bd);
  color: var(--other-fg); }
.tok.dis { box-shadow: inset 0 -4px 0 -2px rgba(0, 0, 0, 0.25); }
.tok:hover, .tok:focus { filter: brightness(0.93); }
.tok .ws, .ctext .ws { color: var(--muted); font-size: 0.8em; }
.tok .tip { display: none; position: absolute; left: 0; top: calc(100% + 6px); z-index: 20;
  min-width: 240px; max-width: 360px; background: #111827; color: #f3f4f6;
  font: 12px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  white-space: normal; overflow-wrap: normal; word-break: normal; padding: 9px 11px;
  border-radius: 7px; cursor: default; box-shadow: 0 8px 24px rgba(0, 0, 0, 0.25); }
.tok:hover .tip, .tok:focus .tip, .tok.pinned .tip { display: block; }
.tip .th { font-weight: 700; margin-bottom: 4px; color: #fff; }
.tip table { border-collapse: collapse; width: 100%; }
.tip td { padding: 1px 6px 1px 0; vertical-align: top; }
.tip td.k { color: #9ca3af; white-space: nowrap; }
.tip .sep { border-top: 1px solid #374151; margin: 5px 0; }
.tip .chosen { color: #86efac; }
.legend { display: flex; flex-wrap: wrap; gap: 8px 18px; margin-top: 14px; font-size: 13px;
  color: var(--muted); }
.legend .sw { display: inline-block; width: 14px; height: 14px; border-radius: 3px;
  vertical-align: -2px; margin-right: 6px; border-bottom: 2px solid transparent; }
.sw.src-agree { background: var(--agree-bg); border-color: var(--agree-bd); }
.sw.src-rag { background: var(--rag-bg); border-color: var(--rag-bd); }
.sw.src-llm { background: var(--llm-bg); border-color: var(--llm-bd); }
.sw.src-other { background: var(--other-bg); border-color: var(--other-bd); }
.stats { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px; }
.stat { border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.stat .k { font-size: 12px; color: var(--muted); }
.stat .v { font-size: 15px; font-weight: 600; overflow-wrap: break-word; white-space: pre-line; }
.bar { display: flex; height: 10px; border-radius: 5px; overflow: hidden; margin: 14px 0 6px;
  background: var(--line); }
.bar span { display: block; height: 100%; }
.bar .src-agree { background: #b6bec9; } .bar .src-rag { background: var(--rag-bd); }
.bar .src-llm { background: var(--llm-bd); } .bar .src-other { background: var(--other-bd); }
.chips { display: flex; flex-wrap: wrap; gap: 8px; font-size: 13px; }
.chip { border-radius: 999px; padding: 2px 10px; border: 1px solid var(--line); }
.chip.src-agree { background: var(--agree-bg); } .chip.src-rag { background: var(--rag-bg); }
.chip.src-llm { background: var(--llm-bg); } .chip.src-other { background: var(--other-bg); }
.warnings { background: #fffbeb; border-color: #fcd34d; }
.warnings ul { margin: 0; padding-left: 20px; }
.warnings li { color: #78350f; margin: 2px 0; white-space: pre-wrap; }
table.data { border-collapse: collapse; width: 100%; font-size: 13px; }
table.data th { text-align: left; font-weight: 600; color: var(--muted); font-size: 12px;
  border-bottom: 1px solid var(--line); padding: 6px 8px; white-space: nowrap; }
table.data td { border-bottom: 1px solid var(--line); padding: 6px 8px; vertical-align: top; }
table.data tr:last-child td { border-bottom: none; }
.scroll { overflow-x: auto; max-width: 100%; }
table.data td.txt { white-space: normal; overflow-wrap: break-word; min-width: 10ch;
  max-width: 28ch; font: 12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: nowrap; }
code.ctext { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  white-space: pre; background: #f3f4f6; border: 1px solid var(--line); border-radius: 4px;
  padding: 1px 4px; }
code.ctext.win { border-color: #111827; }
.prob { color: var(--muted); font-size: 12px; margin-left: 4px; }
.badge { display: inline-block; border-radius: 4px; padding: 0 6px; font-size: 12px;
  font-weight: 600; border: 1px solid var(--line); white-space: nowrap; }
.badge.src-agree { background: var(--agree-bg); } .badge.src-rag { background: var(--rag-bg);
  color: var(--rag-fg); } .badge.src-llm { background: var(--llm-bg); color: var(--llm-fg); }
.badge.src-other { background: var(--other-bg); color: var(--other-fg); }
.badge.kept { background: #dcfce7; color: #166534; } .badge.cut { background: #fef3c7;
  color: #92400e; } .badge.dropped { background: #fee2e2; color: #991b1b; }
details summary { cursor: pointer; color: var(--muted); font-size: 13px; }
.ptext { white-space: pre-wrap; overflow-wrap: anywhere; font-size: 13px; margin: 6px 0 0;
  color: #374151; }
.muted { color: var(--muted); }
tr.hl td { background: #fffbe6; }
"""

# Clicking a token pins its tooltip (useful on touch screens); clicking again unpins it.
_JS = """
document.querySelectorAll('.tok').forEach(function (t) {
  t.addEventListener('click', function (e) {
    if (e.target.closest('.tip')) return;
    var on = t.classList.contains('pinned');
    document.querySelectorAll('.tok.pinned').forEach(function (o) { o.classList.remove('pinned'); });
    if (!on) t.classList.add('pinned');
  });
});
"""


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _token_html(text: str) -> str:
    """Escaped token text for the answer: newlines and tabs shown as marks (and kept as
    line breaks), other control characters as ``\\xNN``, an empty token as ``∅``."""
    if text == "":
        return '<span class="ws">∅</span>'
    out: list[str] = []
    for ch in text:
        if ch == "\n":
            out.append('<span class="ws">↵</span>\n')
        elif ch == "\t":
            out.append('<span class="ws">⇥</span>\t')
        elif ch == "\r":
            out.append('<span class="ws">␍</span>')
        elif ch < " " or ch == "\x7f":
            out.append(f'<span class="ws">\\x{ord(ch):02x}</span>')
        else:
            out.append(html.escape(ch, quote=True))
    return "".join(out)


def _code(text: str, *, chosen: bool = False) -> str:
    """A token in a small code box (whitespace preserved, newlines as ``↵``)."""
    cls = "ctext win" if chosen else "ctext"
    return f'<code class="{cls}">{_token_html(text).replace(chr(10), "")}</code>'


def _tooltip_html(step: TraceStep) -> str:
    rows = []
    for role, cand in step.candidates.items():
        chosen = cand.token_id == step.token_id
        mark = " ✓" if chosen else ""
        cls = ' class="chosen"' if chosen else ""
        rows.append(
            f'<tr{cls}><td class="k">{_esc(_ROLE_LABELS.get(role, role))}</td>'
            f"<td>{_esc(_visible(cand.text))}</td><td>p={format_value(cand.prob)}{mark}</td></tr>"
        )
    sig_rows = "".join(
        f'<tr><td class="k">{_esc(k)}</td><td colspan="2">{_esc(format_value(v))}</td></tr>'
        for k, v in _ordered_signals(step.signals)
    )
    parts = [
        f'<div class="th">step {step.index} · {_esc(step.source)} · '
        f"{_esc(source_label(step.source))}</div>",
        f"<div>token <b>{_esc(_visible(step.text))}</b> (id {step.token_id})</div>",
    ]
    if rows:
        parts.append(f'<div class="sep"></div><table>{"".join(rows)}</table>')
    if sig_rows:
        parts.append(f'<div class="sep"></div><table>{sig_rows}</table>')
    return f'<span class="tip" role="tooltip">{"".join(parts)}</span>'


def _answer_html(trace: Trace) -> str:
    if not trace.steps:
        return f'<div class="answer">{_esc(trace.text) or "<span class=muted>(empty)</span>"}</div>'
    spans = []
    for step in trace.steps:
        classes = f"tok {_source_class(step.source)}" + (" dis" if step.disagreement else "")
        spans.append(
            f'<span class="{classes}" tabindex="0" data-step="{step.index}" '
            f'data-source="{_esc(step.source)}">{_token_html(step.text)}{_tooltip_html(step)}</span>'
        )
    return f'<div class="answer">{"".join(spans)}</div>'


def _legend_html(trace: Trace) -> str:
    labels = [AGREE, FROM_RAG, FROM_LLM]
    labels += sorted({s.source for s in trace.steps} - set(labels))
    items = "".join(
        f'<span><span class="sw {_source_class(lab)}"></span><b>{_esc(lab)}</b> '
        f"— {_esc(source_label(lab) if lab in _SOURCE_LABELS else 'other policy label')}</span>"
        for lab in labels
    )
    return (
        f'<div class="legend">{items}<span>Underlined tokens: the contexts disagreed. '
        "Hover or click a token for its candidates and signals.</span></div>"
    )


def _stop_text(stop_reason: str | None) -> str:
    """The stop reason, saying so when the answer was cut at the token limit."""
    if stop_reason == "length":
        return "length (cut at max_new_tokens)"
    return stop_reason or "—"


def _summary_html(trace: Trace) -> str:
    counts = trace.counts()
    total = sum(counts.values())
    n_dis = len(trace.disagreement_steps)
    stats = [
        ("Policy", trace.policy or "—"),
        ("Model", trace.model or "—"),
        ("Generated tokens", str(total)),
        ("Disagreement steps", str(n_dis)),
        ("Stop reason", _stop_text(trace.stop_reason)),
    ]
    if trace.prompt_tokens:
        stats.append(
            ("Prompt tokens", "\n".join(f"{k} {v}" for k, v in trace.prompt_tokens.items()))
        )
    if trace.timings:
        stats.append(
            ("Timings", "\n".join(f"{k} {format_timing(k, v)}" for k, v in trace.timings.items()))
        )
    stat_html = "".join(
        f'<div class="stat"><div class="k">{_esc(k)}</div><div class="v">{_esc(v)}</div></div>'
        for k, v in stats
    )
    order = [AGREE, FROM_RAG, FROM_LLM] + sorted(set(counts) - {AGREE, FROM_RAG, FROM_LLM})
    present = [lab for lab in order if counts.get(lab)]
    bar = "".join(
        f'<span class="{_source_class(lab)}" style="width:{100 * counts[lab] / total:.2f}%" '
        f'title="{_esc(lab)}: {counts[lab]}"></span>'
        for lab in present
    )
    chips = "".join(
        f'<span class="chip {_source_class(lab)}"><b>{_esc(lab)}</b> {counts[lab]} '
        f'<span class="muted">({100 * counts[lab] / total:.0f} %)</span></span>'
        for lab in present
    )
    options = ""
    if trace.options:
        opts = ", ".join(f"{k}={format_value(v)}" for k, v in trace.options.items())
        options = (
            f'<p class="muted" style="margin:10px 0 0;font-size:13px">Options: {_esc(opts)}</p>'
        )
    dist = f'<div class="bar">{bar}</div><div class="chips">{chips}</div>' if total else ""
    return f'<div class="stats">{stat_html}</div>{dist}{options}'


def _warnings_html(trace: Trace) -> str:
    if not trace.warnings:
        return ""
    items = "".join(f"<li>{_esc(w)}</li>" for w in trace.warnings)
    return f'<section class="card warnings"><h2>Warnings</h2><ul>{items}</ul></section>'


def _passages_html(trace: Trace) -> str:
    if not trace.passages:
        return (
            '<section class="card"><h2>Passages</h2><p class="muted" style="margin:0">'
            "No passages: the answer was generated from the model alone.</p></section>"
        )
    rows = []
    for p in trace.passages:
        status = _passage_status(p)
        source = _passage_source(p)
        preview = p.text if len(p.text) <= 140 else p.text[:140].rstrip() + "…"
        source_html = f'<div class="muted">{_esc(source)}</div>' if source else ""
        rows.append(
            f'<tr><td class="num">{p.rank}</td><td class="num">{format_value(p.score)}</td>'
            f'<td><span class="badge {status}">{status}</span></td>'
            f'<td class="num">{p.n_tokens}</td>'
            f"<td>{source_html}<details><summary>{_esc(preview)}</summary>"
            f'<div class="ptext">{_esc(p.text)}</div></details></td></tr>'
        )
    return (
        '<section class="card"><h2>Passages</h2><table class="data"><thead><tr>'
        "<th>Rank</th><th>Score</th><th>Status</th><th>Tokens</th><th>Passage</th>"
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _signal_cell(value: Any) -> str:
    """A signal's table cell: numbers right-aligned on one line, lists and text wrapped."""
    if value is None or isinstance(value, (bool, int, float)):
        return f'<td class="num">{_esc(format_value(value))}</td>'
    return f'<td class="txt">{_esc(format_value(value))}</td>'


def _disagreements_html(trace: Trace) -> str:
    steps = trace.disagreement_steps
    if not steps:
        return (
            '<section class="card"><h2>Disagreement steps</h2><p class="muted" style="margin:0">'
            "The contexts agreed on every token.</p></section>"
        )
    roles = _roles(steps)
    keys = _signal_keys(steps)
    head = (
        "<th>Step</th><th>Chosen</th>"
        + "".join(f"<th>{_esc(_ROLE_LABELS.get(r, r))}</th>" for r in roles)
        # long signal names may wrap after an underscore, never inside a word
        + "".join(f"<th>{_esc(k).replace('_', '_<wbr>')}</th>" for k in keys)
    )
    rows = []
    for s in steps:
        cells = [
            f'<td class="num">{s.index}</td>',
            f'<td style="white-space:nowrap">{_code(s.text)} <span class="badge {_source_class(s.source)}">'
            f"{_esc(s.source)}</span></td>",
        ]
        for role in roles:
            cand: Candidate | None = s.candidates.get(role)
            if cand is None:
                cells.append('<td class="muted">—</td>')
            else:
                win = cand.token_id == s.token_id
                cells.append(
                    f'<td>{_code(cand.text, chosen=win)}<span class="prob">'
                    f"{format_value(cand.prob)}</span></td>"
                )
        cells += [_signal_cell(s.signals.get(k)) for k in keys]
        rows.append(f'<tr id="step-{s.index}">{"".join(cells)}</tr>')
    return (
        f'<section class="card"><h2>Disagreement steps ({len(steps)})</h2>'
        f'<div class="scroll"><table class="data"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div></section>"
    )


def trace_to_html(trace: Trace) -> str:
    """A standalone HTML page explaining ``trace``.

    The page has inline CSS and a few lines of inline JavaScript (click to pin a tooltip);
    it loads nothing from the network. Every string from the trace is HTML-escaped.

    Sections: the question; the answer with one coloured span per generated token (hover
    for both contexts' candidates, their probabilities and the step's signals) and a legend;
    a summary (policy, model, tokens per source, stop reason, prompt sizes, timings); the
    warnings; the passages (rank, score, kept/cut/dropped, tokens); and a table of the steps
    where the contexts disagreed.
    """
    title = f"Tok-RAG trace — {trace.query}" if trace.query else "Tok-RAG trace"
    sub = " · ".join(x for x in (trace.policy, trace.model) if x)
    body = f"""
<main>
<header class="top"><h1>Tok-RAG trace</h1><div class="meta">{_esc(sub)}</div></header>
<section class="card"><h2>Question</h2><div class="question">{_esc(trace.query)}</div></section>
<section class="card"><h2>Answer</h2>{_answer_html(trace)}{_legend_html(trace)}
<details style="margin-top:12px"><summary>Plain text</summary>
<div class="ptext">{_esc(trace.text)}</div></details></section>
<section class="card"><h2>Summary</h2>{_summary_html(trace)}</section>
{_warnings_html(trace)}
{_passages_html(trace)}
{_disagreements_html(trace)}
</main>"""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>{body}\n"
        f"<script>{_JS}</script>\n</body>\n</html>\n"
    )


# ============================================================================ terminal
def _rich_style(source: str) -> str:
    return _RICH_STYLES.get(source, _RICH_OTHER)


def _margin(signals: Mapping[str, Any]) -> float | None:
    """Eq. 19's margin of a step: the rule's own ``margin`` signal, else cos_ir − cos_llm;
    None where the step was decided without comparing (a function word, agreement)."""
    if isinstance(signals.get("margin"), (int, float)):
        return float(signals["margin"])
    ir, llm = signals.get("cos_ir"), signals.get("cos_llm")
    if isinstance(ir, (int, float)) and isinstance(llm, (int, float)):
        return float(ir) - float(llm)
    return None


def _margin_threshold(trace: Trace, steps: Sequence[TraceStep]) -> float | None:
    """The threshold Eq. 19's margin is compared with, when the trace's policy has one and
    compares cosines (``scorer="cosine"``) at some of ``steps``; else None."""
    options = trace.options or {}
    threshold = options.get("threshold")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
        return None
    if options.get("scorer", "cosine") != "cosine":
        return None
    return float(threshold) if any(_margin(s.signals) is not None for s in steps) else None


def render_trace(trace: Trace, console: Console | None = None) -> None:
    """Print ``trace`` to the terminal with rich.

    Shows the question, the answer with tokens coloured by source, a legend, a one-line
    summary, a table of the disagreement steps (step, RAG and LLM candidates, chosen token,
    l*, cos_ir, cos_llm and, for a policy with a margin threshold, the margin, with the
    threshold in the table's title) and the warnings.

    Args:
        trace: The trace to show.
        console: Where to print; a new :class:`rich.console.Console` by default.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()

    console.rule("[bold]Tok-RAG trace")
    console.print(Text.assemble(("Question: ", "bold"), trace.query))

    answer = Text()
    answer.append("Answer: ", style="bold")
    if trace.steps:
        for step in trace.steps:
            answer.append(step.text, style=_rich_style(step.source) or None)
    else:
        answer.append(trace.text)
    console.print(answer)

    legend = Text("Legend: ", style="dim")
    labels = [AGREE, FROM_RAG, FROM_LLM]
    labels += sorted({s.source for s in trace.steps} - set(labels))
    for i, lab in enumerate(labels):
        if i:
            legend.append("  ")
        legend.append(f"■ {lab}", style=_rich_style(lab) or "grey62")
        meaning = source_label(lab) if lab in _SOURCE_LABELS else "other policy label"
        legend.append(f" ({meaning})", style="dim")
    console.print(legend)

    counts = trace.counts()
    count_text = ", ".join(f"{k} {v}" for k, v in counts.items()) or "no tokens"
    summary = (
        f"policy {trace.policy or '—'} · model {trace.model or '—'} · {count_text}"
        f" · stop: {_stop_text(trace.stop_reason)}"
    )
    console.print(Text(summary, style="dim"))

    steps = trace.disagreement_steps
    if steps:
        roles = _roles(steps)
        other_roles = [r for r in roles if r not in ("rag", "pure", "llm")]
        threshold = _margin_threshold(trace, steps)
        title = f"Disagreement steps ({len(steps)})"
        if threshold is not None:
            # Without it a RAG token with cos_ir < cos_llm (allowed by a negative threshold)
            # reads as a contradiction of the rule.
            title += f" · RAG wins where cos_ir − cos_llm ≥ threshold {format_value(threshold)}"
        table = Table(title=title, title_justify="left")
        table.add_column("step", justify="right")
        table.add_column("rag candidate")
        table.add_column("llm candidate")
        if other_roles:
            table.add_column("other candidates")
        table.add_column("chosen")
        for header in ("l*", "cos_ir", "cos_llm"):
            table.add_column(header, justify="right")
        if threshold is not None:
            table.add_column("margin", justify="right")
        # A gate keeps RAG's token without (or against) the margin: say which one did.
        gated = any(s.signals.get("note") for s in steps)
        if gated:
            table.add_column("kept by")

        def cand_text(cand: Candidate | None) -> str:
            return "—" if cand is None else f"{_visible(cand.text)} ({format_value(cand.prob)})"

        for s in steps:
            llm_cand = s.candidates.get("pure") or s.candidates.get("llm")
            row: list[str | Text] = [
                str(s.index),
                Text(cand_text(s.candidates.get("rag"))),
                Text(cand_text(llm_cand)),
            ]
            if other_roles:
                row.append(
                    Text("; ".join(f"{r}: {cand_text(s.candidates.get(r))}" for r in other_roles))
                )
            row.append(Text(f"{_visible(s.text)} ({s.source})", style=_rich_style(s.source)))
            row += [format_value(s.signals.get(k)) for k in ("l_star", "cos_ir", "cos_llm")]
            if threshold is not None:
                row.append(format_value(_margin(s.signals)))
            if gated:
                note = s.signals.get("note") or ""
                row.append(note.removeprefix("gated: ") if note.startswith("gated: ") else note)
            table.add_row(*row)
        console.print(table)
    else:
        console.print(
            Text("No disagreement steps: the contexts agreed on every token.", style="dim")
        )

    for w in trace.warnings:
        console.print(Text.assemble(("warning: ", "bold yellow"), w))
