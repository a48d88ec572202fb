"""What a decode returns: :class:`GenerationResult` (the answer, its ids and its trace) and,
token by token while it runs, :class:`TokenEvent`; and the incremental detokenisation that
keeps streamed text and final text equal (:class:`_TextTracker`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .trace import Trace, TraceStep

__all__ = ["GenerationResult", "TokenEvent"]


@dataclass
class GenerationResult:
    """The answer, its token ids and the trace explaining it."""

    text: str
    trace: Trace
    token_ids: list[int] = field(default_factory=list)

    @property
    def stop_reason(self) -> str:
        return self.trace.stop_reason

    @property
    def counts(self) -> dict[str, int]:
        return self.trace.counts()

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """One entry per generated token in OpenAI's content-logprob shape: ``token``,
        ``logprob`` (under the distribution the token was taken from; None where the rule
        gives none), ``bytes`` (the token text's UTF-8) and ``top_logprobs`` (the call's
        ``top_logprobs`` most likely tokens, each with ``token``, ``logprob``, ``bytes``)."""
        return [
            {
                "token": s.text,
                "logprob": s.logprob,
                "bytes": list(s.text.encode("utf-8")),
                "top_logprobs": [
                    {"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode("utf-8"))}
                    for t in s.top_logprobs
                ],
            }
            for s in self.trace.steps
        ]


@dataclass
class TokenEvent:
    """One chosen token, yielded by :func:`stream` as soon as it is chosen.

    ``text`` is the new answer text this token adds (may be empty while a possible stop
    string is held back, or for a partial multi-byte character); ``source`` its provenance.
    """

    query_idx: int
    index: int
    token_id: int
    text: str
    source: str
    step: TraceStep


def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    return [s for s in stop if s]


class _TextTracker:
    """Incremental detokenisation with stop-string hold-back, so streamed deltas always add up
    to the final text."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tok = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = 0
        self.final: str | None = None

    def text(self) -> str:
        t = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            i = t.find(s)
            if i >= 0:
                t = t[:i]
        return t

    def push(self, token_id: int | None, finished: bool) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        t = self.text()
        safe = len(t)
        if finished:
            self.final = t
        else:
            if t.endswith("\ufffd"):
                safe = len(t.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, len(t)), 0, -1):
                    if t.endswith(s[:k]):
                        safe = min(safe, len(t) - k)
                        break
        delta = t[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta
