"""What a prompt is made of: the passages (:class:`Passage`), a framework's own rendered RAG
prompt (:class:`RenderedPrompt`) and the two contexts built for one query (:class:`PromptPlan`)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..trace import PassageRecord
from .chat_template import clean_text


@dataclass
class Passage:
    """A retrieved passage: its text (lone surrogates replaced by U+FFFD, with a warning), the
    retriever's score (a number or None, higher = better) and metadata."""

    text: str
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Passage text must be a string, got {type(self.text).__name__}")
        self.text = clean_text(self.text, "a passage", stacklevel=5)
        if self.score is not None and (
            isinstance(self.score, bool) or not isinstance(self.score, numbers.Real)
        ):
            raise TypeError(f"Passage score must be a number or None, got {type(self.score).__name__}")
        if self.metadata is None:
            self.metadata = {}
        elif not isinstance(self.metadata, dict):
            raise TypeError(f"Passage metadata must be a dict, got {type(self.metadata).__name__}")


def as_passages(items: Sequence[Any] | None) -> list[Passage]:
    """Normalise strings / Passage objects / (text, score) pairs into Passage objects."""
    out: list[Passage] = []
    for i, it in enumerate(items or []):
        if isinstance(it, Passage):
            out.append(it)
        elif isinstance(it, str):
            out.append(Passage(it))
        elif isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str):
            out.append(Passage(it[0], None if it[1] is None else float(it[1])))
        else:
            raise TypeError(
                f"passage {i} is a {type(it).__name__}; pass str, Passage or (text, score) tuples"
            )
    return out


@dataclass
class PromptPlan:
    """Token ids of both contexts plus where every retrieved token sits.

    ``rag_ids`` = head + Σ(delimiter + passage + separator) + question/tail;
    ``passage_spans[j]`` = [start, end) of kept passage j inside ``rag_ids``.
    """

    query: str
    pure_ids: list[int]
    rag_ids: list[int]
    passage_spans: list[tuple[int, int]]
    passages: list[PassageRecord]
    warnings: list[str]
    head_ids: list[int] = field(default_factory=list, repr=False)
    tail_ids: list[int] = field(default_factory=list, repr=False)
    passage_segments: list[list[int]] = field(default_factory=list, repr=False)
    kept_passages: list[Passage] = field(default_factory=list, repr=False)

    @property
    def retrieved_positions(self) -> list[int]:
        return [p for s, e in self.passage_spans for p in range(s, e)]

    @property
    def has_passages(self) -> bool:
        return bool(self.passage_spans)

    def single_passage_context(self, j: int) -> tuple[list[int], list[int]]:
        """(ids, retrieved positions) of a context holding only kept passage ``j`` (RAG-Token)."""
        seg = self.passage_segments[j]
        ids = list(self.head_ids)
        start = len(ids) + self._delim_len
        ids += seg
        end = start + (self.passage_spans[j][1] - self.passage_spans[j][0])
        ids += self.tail_ids
        return ids, list(range(start, end))

    _delim_len: int = field(default=0, repr=False)


@dataclass
class RenderedPrompt:
    """A RAG prompt formatted by the caller's (a framework's) template: exactly one of
    ``messages`` (chat turns, rendered with the chat template) or ``text`` (a finished prompt,
    encoded as given). ``context`` is what the template's context variable received; its first
    occurrence is the retrieved span (rt_1..rt_m of Eq. 15-16), the rest is not retrieved.
    ``passages`` (optional): ``context`` cut into consecutive passages (their texts, in order,
    make up ``context``), each its own span of the retrieved tokens, so citations and the
    per-passage policies name them; the retrieved tokens are the same either way.
    """

    context: str
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    passages: list[Passage] | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError("RenderedPrompt needs exactly one of messages= or text=")
        if not isinstance(self.context, str):
            raise TypeError(f"RenderedPrompt context must be a string, got {type(self.context).__name__}")
        if self.passages is not None and sum(len(p.text) for p in self.passages) != len(self.context):
            raise ValueError("RenderedPrompt passages must make up its context, in order")
