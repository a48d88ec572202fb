"""What the renderers read from a trace, as structural types.

:class:`~tokrag_integrations.trace.Trace` and its parts satisfy these protocols; naming them
here keeps the renderers free of any import of :mod:`tokrag_integrations.trace` (which
imports the renderers for ``Trace.to_html`` and ``Trace.render``), so the two never form an
import cycle, not even a type-only one. Members holding other views are read-only properties.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class CandidateView(Protocol):
    """One context's top-1 candidate at a step."""

    token_id: int
    text: str
    prob: float


class StepView(Protocol):
    """One generated token, its candidates per context and the signals behind the choice."""

    index: int
    token_id: int
    text: str
    source: str
    signals: dict[str, Any]

    @property
    def candidates(self) -> Mapping[str, CandidateView]: ...
    @property
    def disagreement(self) -> bool: ...


class PassageView(Protocol):
    """One passage given to the model, and whether it fit."""

    rank: int
    text: str
    score: float | None
    n_tokens: int
    kept: bool
    cut: bool
    metadata: dict[str, Any]


class CitationView(Protocol):
    """Generated tokens ``start`` .. ``end - 1`` cited to passage ``passage`` (an index into
    the trace's passages; None: no citation)."""

    start: int
    end: int
    text: str
    passage: int | None
    score: float | None
    source: str | None


class TraceView(Protocol):
    """A whole decode: question, answer, steps, passages, settings and timings."""

    query: str
    policy: str
    model: str
    options: dict[str, Any]
    warnings: list[str]
    text: str
    stop_reason: str
    prompt_tokens: dict[str, int]
    timings: dict[str, float]
    speed: dict[str, Any]

    @property
    def passages(self) -> Sequence[PassageView]: ...
    @property
    def steps(self) -> Sequence[StepView]: ...
    @property
    def disagreement_steps(self) -> Sequence[StepView]: ...
    def counts(self) -> dict[str, int]: ...
    def citations(self, by: str = "run") -> Sequence[CitationView]: ...
    def contributions(self) -> list[tuple[int, float]]: ...
