"""Labels, value formatting and step helpers shared by the HTML page and the terminal view."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..labels import AGREE, FROM_PURE, FROM_RAG
from ._view import PassageView, StepView, TraceView

#: Human-readable meaning of the two-context source labels.
SOURCE_LABELS: dict[str, str] = {
    AGREE: "both contexts agree",
    FROM_RAG: "from retrieval",
    FROM_PURE: "from the model",
}
#: Display names of the context roles found in ``StepView.candidates``.
ROLE_LABELS: dict[str, str] = {"rag": "RAG context", "pure": "pure context"}
#: Signals shown first (in this order) wherever signals are listed; others follow sorted.
_SIGNAL_ORDER = ("l_star", "cos_ir", "cos_llm", "fusion_attn_layer", "fusion_jsd_layer")


def legend(sources: Iterable[str]) -> list[tuple[str, str]]:
    """``(label, meaning)`` for the three two-context labels, then any other of ``sources``."""
    labels = list(SOURCE_LABELS) + sorted(set(sources) - set(SOURCE_LABELS))
    return [(lab, SOURCE_LABELS.get(lab, "other policy label")) for lab in labels]


def source_class(source: str) -> str:
    """CSS class for a source: one per known label, one shared neutral-amber class otherwise."""
    return f"src-{source}" if source in SOURCE_LABELS else "src-other"


def format_value(value: Any) -> str:
    """A signal or score as short text: floats with 4 digits, sequences and dicts
    element-wise."""
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
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


#: Timing entries that are on/off flags (stored as 0.0 / 1.0 floats).
_TIMING_FLAGS = frozenset({"fused", "packed"})


def format_timing(key: str, value: Any) -> str:
    """One ``TraceView.timings`` entry as text: seconds (``*_s``) with 4 digits, flags as
    ``on``/``off``, counts (whole numbers) as integers."""
    if isinstance(value, bool) or (key in _TIMING_FLAGS and value in (0, 1)):
        return "on" if value else "off"
    if key.endswith("_s") or not isinstance(value, (int, float)):
        return format_value(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format_value(value)


def visible(text: str) -> str:
    """Token text with whitespace made visible, for tables (one line, no escaping)."""
    if text == "":
        return "∅"
    out = text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    return "".join(c if c >= " " or c in "↵⇥" else f"\\x{ord(c):02x}" for c in out)


def ordered_signals(signals: Mapping[str, Any]) -> list[tuple[str, Any]]:
    known = [(k, signals[k]) for k in _SIGNAL_ORDER if k in signals]
    rest = sorted((k, v) for k, v in signals.items() if k not in _SIGNAL_ORDER)
    return known + rest


def signal_keys(steps: Iterable[StepView]) -> list[str]:
    return [k for k, _ in ordered_signals({k: None for s in steps for k in s.signals})]


def roles_of(steps: Iterable[StepView]) -> list[str]:
    """CandidateView roles in a stable order: rag, pure, then the rest as first seen."""
    seen = list(dict.fromkeys(role for s in steps for role in s.candidates))
    first = [r for r in ("rag", "pure") if r in seen]
    return first + [r for r in seen if r not in first]


def passage_status(p: PassageView) -> str:
    if not p.kept:
        return "dropped"
    return "cut" if p.cut else "kept"


def passage_source(p: PassageView) -> str:
    md = p.metadata or {}
    for key in ("source", "file_name", "file_path", "url", "id"):
        if md.get(key) not in (None, ""):
            return str(md[key])
    return ""


def stop_text(stop_reason: str | None) -> str:
    """The stop reason, saying so when the answer was cut at the token limit."""
    if stop_reason == "length":
        return "length (cut at max_new_tokens)"
    return stop_reason or "—"


def cited_spans(trace: TraceView) -> list[tuple[str, str | None, str]]:
    """The answer's citation spans as (text, mark, tooltip): the mark is ``[rank]`` of the
    cited passage (None for tokens without a citation), the tooltip its source and score.
    Empty where no token carries a citation."""
    spans = trace.citations()
    if all(c.passage is None for c in spans):
        return []
    out = []
    for c in spans:
        if c.passage is None:
            out.append((c.text, None, "no citation: decoded without the passages' attention"))
            continue
        rank = trace.passages[c.passage].rank
        tip = f"passage [{rank}] {c.source or ''} · attention share {format_value(c.score)}"
        out.append((c.text, f"[{rank}]", tip))
    return out
