"""The standalone HTML page of a trace: the answer with every token coloured by its source
and a tooltip per token (each context's top-1 candidate, the signals), a summary, the
passages and a table of the steps where the contexts disagreed."""

from __future__ import annotations

import html
import re
from typing import Any

from ._assets import CSS, JS
from ._common import (
    ROLE_LABELS,
    SOURCE_LABELS,
    cited_spans,
    format_timing,
    format_value,
    legend,
    ordered_signals,
    passage_source,
    passage_status,
    roles_of,
    signal_keys,
    source_class,
    stop_text,
    visible,
)
from ._view import CandidateView, StepView, TraceView


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _token_html(text: str) -> str:
    """Escaped token text for the answer: newlines and tabs shown as marks (and kept as
    line breaks), other control characters as ``\\xNN``, an empty token as ``∅``."""
    if text == "":
        return '<span class="ws">∅</span>'

    def mark(m: re.Match[str]) -> str:
        ch = m.group(0)
        shown = {"\n": "↵", "\t": "⇥", "\r": "␍"}.get(ch, f"\\x{ord(ch):02x}")
        return f'<span class="ws">{shown}</span>' + (ch if ch in "\n\t" else "")

    return re.sub("[\x00-\x1f\x7f]", mark, _esc(text))


def _code(text: str, *, chosen: bool = False) -> str:
    """A token in a small code box (whitespace preserved, newlines as ``↵``)."""
    cls = "ctext win" if chosen else "ctext"
    return f'<code class="{cls}">{_token_html(text).replace(chr(10), "")}</code>'


def _tooltip_html(step: StepView) -> str:
    rows = []
    for role, cand in step.candidates.items():
        chosen = cand.token_id == step.token_id
        mark = " ✓" if chosen else ""
        cls = ' class="chosen"' if chosen else ""
        rows.append(
            f'<tr{cls}><td class="k">{_esc(ROLE_LABELS.get(role, role))}</td>'
            f"<td>{_esc(visible(cand.text))}</td><td>p={format_value(cand.prob)}{mark}</td></tr>"
        )
    sig_rows = "".join(
        f'<tr><td class="k">{_esc(k)}</td><td colspan="2">{_esc(format_value(v))}</td></tr>'
        for k, v in ordered_signals(step.signals)
    )
    parts = [
        f'<div class="th">step {step.index} · {_esc(step.source)} · '
        f"{_esc(SOURCE_LABELS.get(step.source, step.source))}</div>",
        f"<div>token <b>{_esc(visible(step.text))}</b> (id {step.token_id})</div>",
    ]
    if rows:
        parts.append(f'<div class="sep"></div><table>{"".join(rows)}</table>')
    if sig_rows:
        parts.append(f'<div class="sep"></div><table>{sig_rows}</table>')
    return f'<span class="tip" role="tooltip">{"".join(parts)}</span>'


def _answer_html(trace: TraceView) -> str:
    if not trace.steps:
        return f'<div class="answer">{_esc(trace.text) or "<span class=muted>(empty)</span>"}</div>'
    spans = []
    for step in trace.steps:
        classes = f"tok {source_class(step.source)}" + (" dis" if step.disagreement else "")
        spans.append(
            f'<span class="{classes}" tabindex="0" data-step="{step.index}" '
            f'data-source="{_esc(step.source)}">{_token_html(step.text)}{_tooltip_html(step)}</span>'
        )
    return f'<div class="answer">{"".join(spans)}</div>'


def _citations_html(trace: TraceView) -> str:
    spans = cited_spans(trace)
    if not spans:
        return ""
    parts = []
    for text, mark, tip in spans:
        sup = f"<sup><b>{_esc(mark)}</b></sup>" if mark else ""
        cls = "cite" if mark else "cite muted"
        parts.append(f'<span class="{cls}" title="{_esc(tip)}">{_token_html(text)}{sup}</span>')
    order = ", ".join(
        f"[{trace.passages[j].rank}] {100 * share:.0f} %" for j, share in trace.contributions()
    )
    return (
        '<section class="card"><h2>Citations</h2>'
        f'<div class="answer">{"".join(parts)}</div>'
        '<p class="muted" style="margin:10px 0 0;font-size:13px">Each span is marked with the '
        "passage its tokens attended to most (hover for the share). Passages by contribution: "
        f"{_esc(order)}</p></section>"
    )


def _legend_html(trace: TraceView) -> str:
    items = "".join(
        f'<span><span class="sw {source_class(lab)}"></span><b>{_esc(lab)}</b> '
        f"— {_esc(meaning)}</span>"
        for lab, meaning in legend(s.source for s in trace.steps)
    )
    return (
        f'<div class="legend">{items}<span>Underlined tokens: the contexts disagreed. '
        "Hover or click a token for its candidates and signals.</span></div>"
    )


def _summary_html(trace: TraceView) -> str:
    counts = trace.counts()
    total = sum(counts.values())
    n_dis = len(trace.disagreement_steps)
    stats = [
        ("Policy", trace.policy or "—"),
        ("Model", trace.model or "—"),
        ("Generated tokens", str(total)),
        ("Disagreement steps", str(n_dis)),
        ("Stop reason", stop_text(trace.stop_reason)),
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
    present = [lab for lab, _ in legend(counts) if counts.get(lab)]
    bar = "".join(
        f'<span class="{source_class(lab)}" style="width:{100 * counts[lab] / total:.2f}%" '
        f'title="{_esc(lab)}: {counts[lab]}"></span>'
        for lab in present
    )
    chips = "".join(
        f'<span class="chip {source_class(lab)}"><b>{_esc(lab)}</b> {counts[lab]} '
        f'<span class="muted">({100 * counts[lab] / total:.0f} %)</span></span>'
        for lab in present
    )
    options = ""
    # The rule's options, then how fast it ran (the call's speed, the paths that were off).
    for title, values in (("Options", trace.options), ("Speed", trace.speed)):
        if values:
            text = ", ".join(f"{k}={format_value(v)}" for k, v in values.items())
            options += (
                f'<p class="muted" style="margin:10px 0 0;font-size:13px">{title}: '
                f"{_esc(text)}</p>"
            )
    dist = f'<div class="bar">{bar}</div><div class="chips">{chips}</div>' if total else ""
    return f'<div class="stats">{stat_html}</div>{dist}{options}'


def _warnings_html(trace: TraceView) -> str:
    if not trace.warnings:
        return ""
    items = "".join(f"<li>{_esc(w)}</li>" for w in trace.warnings)
    return f'<section class="card warnings"><h2>Warnings</h2><ul>{items}</ul></section>'


def _passages_html(trace: TraceView) -> str:
    if not trace.passages:
        return (
            '<section class="card"><h2>Passages</h2><p class="muted" style="margin:0">'
            "No passages: the answer was generated from the model alone.</p></section>"
        )
    rows = []
    for p in trace.passages:
        status = passage_status(p)
        source = passage_source(p)
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


def _disagreements_html(trace: TraceView) -> str:
    steps = trace.disagreement_steps
    if not steps:
        return (
            '<section class="card"><h2>Disagreement steps</h2><p class="muted" style="margin:0">'
            "The contexts agreed on every token.</p></section>"
        )
    roles = roles_of(steps)
    keys = signal_keys(steps)
    head = (
        "<th>Step</th><th>Chosen</th>"
        + "".join(f"<th>{_esc(ROLE_LABELS.get(r, r))}</th>" for r in roles)
        # long signal names may wrap after an underscore, never inside a word
        + "".join(f"<th>{_esc(k).replace('_', '_<wbr>')}</th>" for k in keys)
    )
    rows = []
    for s in steps:
        cells = [
            f'<td class="num">{s.index}</td>',
            f'<td style="white-space:nowrap">{_code(s.text)} <span class="badge {source_class(s.source)}">'
            f"{_esc(s.source)}</span></td>",
        ]
        for role in roles:
            cand: CandidateView | None = s.candidates.get(role)
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


def trace_to_html(trace: TraceView) -> str:
    """A standalone HTML page explaining ``trace`` (inline CSS and script, nothing loaded from
    the network; every string from the trace HTML-escaped)."""
    title = f"Tok-RAG trace — {trace.query}" if trace.query else "Tok-RAG trace"
    sub = " · ".join(x for x in (trace.policy, trace.model) if x)
    body = f"""
<main>
<header class="top"><h1>Tok-RAG trace</h1><div class="meta">{_esc(sub)}</div></header>
<section class="card"><h2>Question</h2><div class="question">{_esc(trace.query)}</div></section>
<section class="card"><h2>Answer</h2>{_answer_html(trace)}{_legend_html(trace)}
<details style="margin-top:12px"><summary>Plain text</summary>
<div class="ptext">{_esc(trace.text)}</div></details></section>
{_citations_html(trace)}
<section class="card"><h2>Summary</h2>{_summary_html(trace)}</section>
{_warnings_html(trace)}
{_passages_html(trace)}
{_disagreements_html(trace)}
</main>"""
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>{body}\n"
        f"<script>{JS}</script>\n</body>\n</html>\n"
    )
