"""The terminal view of a trace (rich): the answer coloured by source, a legend, a summary
line, the disagreement steps as a table, the warnings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..labels import AGREE, FROM_PURE, FROM_RAG
from ._common import cited_spans, format_value, legend, roles_of, stop_text, visible
from ._view import CandidateView, StepView, TraceView

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console
    from rich.table import Table

#: Terminal styles per source; other labels are dark orange.
_RICH_STYLES = {AGREE: "", FROM_RAG: "bold green", FROM_PURE: "bold blue"}


def _rich_style(source: str) -> str:
    return _RICH_STYLES.get(source, "bold dark_orange")


def _margin(signals: Mapping[str, Any]) -> float | None:
    """Eq. 19's margin of a step: the rule's own ``margin`` signal, else cos_ir − cos_llm;
    None where the step was decided without comparing (a function word, agreement)."""
    if isinstance(signals.get("margin"), (int, float)):
        return float(signals["margin"])
    ir, llm = signals.get("cos_ir"), signals.get("cos_llm")
    if isinstance(ir, (int, float)) and isinstance(llm, (int, float)):
        return float(ir) - float(llm)
    return None


def _margin_threshold(trace: TraceView, steps: Sequence[StepView]) -> float | None:
    """The threshold Eq. 19's margin is compared with, when the trace's policy has one and
    compares cosines (``scorer="cosine"``) at some of ``steps``; else None."""
    options = trace.options or {}
    threshold = options.get("threshold")
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool):
        return None
    if options.get("scorer", "cosine") != "cosine":
        return None
    return float(threshold) if any(_margin(s.signals) is not None for s in steps) else None


def _disagreement_table(trace: TraceView, steps: Sequence[StepView]) -> Table:
    """The disagreement steps as a rich table: the candidates of each context, the chosen
    token, l*, cos_ir, cos_llm and, under a margin threshold, the margin."""
    from rich.table import Table
    from rich.text import Text

    roles = roles_of(steps)
    other_roles = [r for r in roles if r not in ("rag", "pure")]
    threshold = _margin_threshold(trace, steps)
    title = f"Disagreement steps ({len(steps)})"
    if threshold is not None:
        # Without it a RAG token with cos_ir < cos_llm (allowed by a negative threshold)
        # reads as a contradiction of the rule.
        title += f" · RAG wins where cos_ir − cos_llm ≥ threshold {format_value(threshold)}"
    table = Table(title=title, title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("rag candidate")
    table.add_column("pure candidate")
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

    def cand_text(cand: CandidateView | None) -> str:
        return "—" if cand is None else f"{visible(cand.text)} ({format_value(cand.prob)})"

    for s in steps:
        row: list[str | Text] = [
            str(s.index),
            Text(cand_text(s.candidates.get("rag"))),
            Text(cand_text(s.candidates.get("pure"))),
        ]
        if other_roles:
            row.append(
                Text("; ".join(f"{r}: {cand_text(s.candidates.get(r))}" for r in other_roles))
            )
        row.append(Text(f"{visible(s.text)} ({s.source})", style=_rich_style(s.source)))
        row += [format_value(s.signals.get(k)) for k in ("l_star", "cos_ir", "cos_llm")]
        if threshold is not None:
            row.append(format_value(_margin(s.signals)))
        if gated:
            note = s.signals.get("note") or ""
            row.append(note.removeprefix("gated: "))
        table.add_row(*row)
    return table


def render_trace(trace: TraceView, console: Console | None = None) -> None:
    """Print ``trace`` with rich on ``console`` (default: a new :class:`rich.console.Console`)."""
    from rich.console import Console
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

    key = Text("Legend: ", style="dim")
    for i, (lab, meaning) in enumerate(legend(s.source for s in trace.steps)):
        if i:
            key.append("  ")
        key.append(f"■ {lab}", style=_rich_style(lab) or "grey62")
        key.append(f" ({meaning})", style="dim")
    console.print(key)

    counts = trace.counts()
    count_text = ", ".join(f"{k} {v}" for k, v in counts.items()) or "no tokens"
    summary = (
        f"policy {trace.policy or '—'} · model {trace.model or '—'} · {count_text}"
        f" · stop: {stop_text(trace.stop_reason)}"
    )
    console.print(Text(summary, style="dim"))

    spans = cited_spans(trace)
    if spans:
        cited = Text()
        cited.append("Cited: ", style="bold")
        for text, mark, _tip in spans:
            cited.append(text, style="" if mark else "dim")
            if mark:
                cited.append(mark, style="bold cyan")
        console.print(cited)
        if any(mark is None for _, mark, _ in spans):
            console.print(
                Text(
                    "Dim tokens carry no citation (decoded without the passages' attention).",
                    style="dim",
                )
            )

    steps = trace.disagreement_steps
    if steps:
        console.print(_disagreement_table(trace, steps))
    else:
        console.print(
            Text("No disagreement steps: the contexts agreed on every token.", style="dim")
        )

    for w in trace.warnings:
        console.print(Text.assemble(("warning: ", "bold yellow"), w))
