"""Per-token trace of a decode: which token came from which context, and why.

The trace is the user's explanation of an answer (Tok-RAG paper, Fig. 5 case study). It is a
plain, JSON-serialisable structure; renderers (HTML, terminal) live in :mod:`.render`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .labels import AGREE, FROM_LLM, FROM_RAG

__all__ = ["AGREE", "FROM_LLM", "FROM_RAG", "Candidate", "PassageRecord", "Trace", "TraceStep"]


@dataclass
class Candidate:
    """The top-1 token of one context at one step."""

    token_id: int
    text: str
    prob: float


@dataclass
class TraceStep:
    """One decoding step.

    ``source`` names where the chosen token came from; ``candidates`` maps a context role
    (``"pure"``, ``"rag"``, ``"passage:0"``...) to its top-1 token; ``signals`` holds the
    numbers behind the decision (for Tok-RAG at a disagreement step: ``l_star``,
    ``cos_ir`` = cos(w_RAG, w_IR), ``cos_llm`` = cos(w_RAG, w_LLM), ``fusion_attn_layer``,
    ``fusion_jsd_layer``). ``stats`` maps each context role to a summary of its next-token
    distribution at the chosen token (:func:`.engine.stats.distribution_stats`), which the
    confidence metrics of :mod:`..gating.confidence` read.
    """

    index: int
    token_id: int
    text: str
    source: str
    candidates: dict[str, Candidate] = field(default_factory=dict)
    signals: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def disagreement(self) -> bool:
        ids = {c.token_id for c in self.candidates.values()}
        return len(ids) > 1


@dataclass
class PassageRecord:
    """A passage as it entered (or failed to enter) the RAG context."""

    rank: int
    text: str
    score: float | None = None
    n_tokens: int = 0
    kept: bool = True
    cut: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trace:
    """Everything needed to explain one generated answer."""

    query: str
    policy: str
    model: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    passages: list[PassageRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    steps: list[TraceStep] = field(default_factory=list)
    text: str = ""
    stop_reason: str = ""
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """Number of generated tokens per source label."""
        return dict(Counter(s.source for s in self.steps))

    @property
    def disagreement_steps(self) -> list[TraceStep]:
        return [s for s in self.steps if s.disagreement]

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON data: ``json.dumps`` takes it as is, and ``json.loads`` of that
        gives it back equal (tensors and numpy values become numbers or nested lists, sets
        and tuples lists, dictionary keys strings, other objects their ``str``; non-finite
        floats stay floats, written ``NaN`` / ``Infinity`` as ``json`` does by default)."""
        d = _json_data(asdict(self))
        d["counts"] = self.counts()
        return d

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        d = dict(d)
        d.pop("counts", None)
        steps = [
            TraceStep(
                index=s["index"],
                token_id=s["token_id"],
                text=s["text"],
                source=s["source"],
                candidates={k: Candidate(**c) for k, c in s.get("candidates", {}).items()},
                signals=dict(s.get("signals", {})),
                stats={k: dict(v) for k, v in s.get("stats", {}).items()},
            )
            for s in d.pop("steps", [])
        ]
        passages = [PassageRecord(**p) for p in d.pop("passages", [])]
        return cls(steps=steps, passages=passages, **d)

    def to_html(self, path: str | Path | None = None) -> str:
        """A standalone HTML page colouring each token by its source (scores on hover)."""
        from .render import trace_to_html

        html = trace_to_html(self)
        if path is not None:
            Path(path).write_text(html, encoding="utf-8")
        return html

    def render(self, console: Any = None) -> None:
        """Print the trace to the terminal with rich."""
        from .render import render_trace

        render_trace(self, console=console)


def _json_key(k: Any) -> str:
    """A dictionary key as ``json.dumps`` writes it."""
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, (bool, int, float)):
        return json.dumps(k)
    return str(k)


def _json_data(o: Any) -> Any:
    """``o`` with everything ``json`` cannot write converted (see :meth:`Trace.to_dict`)."""
    if o is None or isinstance(o, (str, bool, int, float)):
        return o
    if isinstance(o, dict):
        return {_json_key(k): _json_data(v) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [_json_data(v) for v in o]
    torch = sys.modules.get("torch")  # a tensor is its (nested) list of numbers
    if torch is not None and isinstance(o, torch.Tensor):
        return _json_data(o.tolist())
    if hasattr(o, "item"):  # numpy scalars and one-element arrays: the number
        try:
            return _json_data(o.item())
        except (ValueError, TypeError, RuntimeError):
            pass
    if hasattr(o, "tolist"):  # other numpy arrays
        return _json_data(o.tolist())
    return str(o)
