"""Per-token trace of a decode: which token came from which context, and why.

The trace is the user's explanation of an answer (Tok-RAG paper, Fig. 5 case study). It is a
plain, JSON-serialisable structure; renderers (HTML, terminal) live in :mod:`.render`.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from .labels import AGREE, FROM_PURE, FROM_RAG

__all__ = [
    "AGREE",
    "FROM_PURE",
    "FROM_RAG",
    "TRACE_VERSION",
    "Candidate",
    "Citation",
    "PassageRecord",
    "TopLogprob",
    "Trace",
    "TraceStep",
    "by_contribution",
    "comparable",
    "json_data",
]

_T = TypeVar("_T")

#: The ``version`` of the JSON :meth:`Trace.to_dict` writes. 2: the token source of the pure
#: context is ``pure`` (version 1: ``llm``), policies ``no_rag`` and ``tokrag_authors``
#: (version 1: ``llm`` and ``tokrag_reference``). A dict without ``version`` is version 1.
TRACE_VERSION = 2
#: Version 1's names -> today's: token sources, then policy names.
_V1_SOURCES = {"llm": FROM_PURE}
_V1_POLICIES = {"llm": "no_rag", "tokrag_reference": "tokrag_authors"}


def by_contribution(
    items: Iterable[_T],
    ranked: Sequence[Any],
    key: Callable[[_T], Any] = lambda item: item,
    decoded: Collection[Any] | None = None,
) -> list[_T]:
    """``items`` the answer drew on first, in the order of ``ranked`` (their keys, the largest
    contribution first: :meth:`Trace.contributions`); then the others in their order, those
    whose key is not in ``decoded`` (when given) last. As given when ``ranked`` is empty (no
    citations). The one ordering of the server's sources and both adapters' documents."""
    rank = {k: r for r, k in enumerate(ranked)}
    if not rank:
        return list(items)

    def place(item: _T) -> tuple[int, int]:
        k = key(item)
        if k in rank:
            return 0, rank[k]
        return (1 if decoded is None or k in decoded else 2), 0

    return sorted(items, key=place)


@dataclass
class Candidate:
    """The top-1 token of one context at one step."""

    token_id: int
    text: str
    prob: float


@dataclass
class TopLogprob:
    """One of the most likely tokens of a step's distribution and its log-probability."""

    token_id: int
    text: str
    logprob: float


@dataclass
class TraceStep:
    """One decoding step.

    ``source`` names where the chosen token came from; ``candidates`` maps a context role
    (``"pure"``, ``"rag"``, ``"passage:0"``...) to its top-1 token; ``signals`` holds the
    numbers behind the decision (for Tok-RAG at a disagreement step: ``l_star``,
    ``cos_ir`` = cos(w_RAG, w_IR), ``cos_llm`` = cos(w_RAG, w_LLM), ``fusion_attn_layer``,
    ``fusion_jsd_layer``). ``stats`` maps each context role to a summary of its next-token
    distribution at the chosen token (:func:`.engine.stats.distribution_stats`), which the
    confidence metrics of :mod:`..gating.confidence` read. ``citation`` (``citations=True``):
    each kept passage's share of the RAG context's attention at this step, in prompt order
    (:func:`.attention.citations.passage_scores`); empty where nothing was read.
    ``logprob``: the token's log-probability under the distribution the rule took it from
    (:attr:`.policies.base.Choice.logits`, after a constraint's mask, before temperature and
    the top-k / top-p cuts; None where the rule gives none, or the token was given);
    ``top_logprobs``: that distribution's most likely tokens (``top_logprobs=`` of the call).
    """

    index: int
    token_id: int
    text: str
    source: str
    candidates: dict[str, Candidate] = field(default_factory=dict)
    signals: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    citation: list[float] = field(default_factory=list)
    logprob: float | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)

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
class Citation:
    """Generated tokens ``start`` .. ``end - 1`` (step indices) and the passage they are cited
    to: ``passage`` indexes :attr:`Trace.passages` (None: these tokens carry no citation),
    ``score`` is that passage's mean share of the attention over the span, ``source`` its
    metadata's ``source`` (None without one)."""

    start: int
    end: int
    text: str
    passage: int | None
    score: float | None
    source: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _sentence_end(text: str) -> bool:
    t = text.rstrip(" ")
    return "\n" in text or t.endswith((".", "!", "?"))


@dataclass
class Trace:
    """Everything needed to explain one generated answer.

    ``options`` are the rule's options (what decides the tokens). ``timings`` (seconds,
    flags, counts) and ``speed`` (the call's :class:`~.speed.Speed` fields, e.g.
    ``fuse``, and ``speed_paths_off``: each speed path that was off at the end of this decode,
    with its reason) say how fast the answer was made and what this machine measured: they may
    differ between two decodes of one call (another machine, or before and after the process
    measured its speed paths) whose tokens and decisions are equal, and
    :meth:`comparable` leaves them out. ``sampling``: the call's ``temperature``, ``top_p``,
    ``top_k`` and ``seed`` (the seed drawn for it where none was given), empty when greedy.
    """

    #: The fields that depend on the machine and the moment, not on the call.
    MEASURED: ClassVar[tuple[str, ...]] = ("timings", "speed")

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
    speed: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        """Number of generated tokens per source label."""
        return dict(Counter(s.source for s in self.steps))

    @property
    def disagreement_steps(self) -> list[TraceStep]:
        return [s for s in self.steps if s.disagreement]

    def cite(self, start: int, end: int) -> tuple[int, float] | None:
        """The passage (index into :attr:`passages`) with the largest share of the attention
        summed over steps ``start`` .. ``end - 1`` and its mean share there; None where none
        of those steps carries a citation."""
        rows = [s.citation for s in self.steps[start:end] if s.citation]
        if not rows:
            return None
        totals = [sum(col) for col in zip(*rows, strict=True)]
        j = max(range(len(totals)), key=totals.__getitem__)
        kept = [i for i, p in enumerate(self.passages) if p.kept]
        return kept[j], totals[j] / len(rows)

    def citations(self, by: str = "run") -> list[Citation]:
        """The answer cut into spans, each cited to one passage, in order.

        ``by="run"``: a span is a run of tokens whose largest attention share goes to the
        same passage, split at sentence ends; ``by="sentence"``: one span per sentence, cited
        to the passage with the largest share summed over it. Tokens without a citation
        (``citations=False``, a policy without a ``rag`` context) form spans with
        ``passage=None``.
        """
        if by not in ("run", "sentence"):
            raise ValueError(f"by must be 'run' or 'sentence', got {by!r}")
        out: list[Citation] = []
        start = 0
        for i, step in enumerate(self.steps):
            last = i + 1 == len(self.steps)
            if not last:
                if by == "run":
                    here, nxt = self.cite(i, i + 1), self.cite(i + 1, i + 2)
                    same = (here and here[0]) == (nxt and nxt[0])
                else:
                    same = bool(step.citation) == bool(self.steps[i + 1].citation)
                if same and not _sentence_end(step.text):
                    continue
            got = self.cite(start, i + 1)
            meta = self.passages[got[0]].metadata if got else {}
            src = meta.get("source")
            out.append(
                Citation(
                    start=start,
                    end=i + 1,
                    text="".join(s.text for s in self.steps[start : i + 1]),
                    passage=got[0] if got else None,
                    score=got[1] if got else None,
                    source=None if src is None else str(src),
                    metadata=dict(meta),
                )
            )
            start = i + 1
        return out

    def citations_data(self, by: str = "run") -> list[dict[str, Any]]:
        """:meth:`citations` as JSON data (one dict per span, the passage's metadata included),
        ``[]`` where no token carries a citation: what the framework adapters and the server
        put in their responses."""
        if not any(s.citation for s in self.steps):
            return []
        return json_data([asdict(c) for c in self.citations(by)])

    def contributions(self) -> list[tuple[int, float]]:
        """(passage index into :attr:`passages`, its share of the attention summed over the
        answer's cited steps), largest first; empty without citations."""
        got = self.cite(0, len(self.steps))
        if got is None:
            return []
        rows = [s.citation for s in self.steps if s.citation]
        kept = [i for i, p in enumerate(self.passages) if p.kept]
        totals = [sum(col) / len(rows) for col in zip(*rows, strict=True)]
        return sorted(zip(kept, totals, strict=True), key=lambda t: -t[1])

    def passage_order(self) -> list[int]:
        """Every passage's index: by :meth:`contributions` first, the others after them in
        prompt order (all in prompt order without citations)."""
        return by_contribution(range(len(self.passages)), [i for i, _ in self.contributions()])

    def to_dict(self) -> dict[str, Any]:
        """The trace as JSON data: ``json.dumps`` takes it as is, and ``json.loads`` of that
        gives it back equal (tensors and numpy values become numbers or nested lists, sets
        and tuples lists, dictionary keys strings, other objects their ``str``; non-finite
        floats stay floats, written ``NaN`` / ``Infinity`` as ``json`` does by default)."""
        d = {"version": TRACE_VERSION, **json_data(asdict(self))}
        d["counts"] = self.counts()
        d["citations"] = json_data([asdict(c) for c in self.citations()])
        return d

    def comparable(self) -> dict[str, Any]:
        """:meth:`to_dict` less the :data:`MEASURED` fields (``timings``, ``speed``): the
        query, policy, model, options, passages, warnings, text, stop reason, prompt tokens,
        and every step's token, source, candidates, signals, stats and citation. Two decodes
        of one call give equal ones wherever and whenever they run (their floats up to
        rounding where the sums run on another number of threads)."""
        return comparable(self.to_dict())

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        """The trace :meth:`to_dict` wrote (or a server sent), checked: a field of the wrong
        type, an unknown field, or a ``citation`` row that is not one share per kept passage
        is a ``ValueError`` naming it (``trace.steps[3].citation``), here rather than an
        ``IndexError`` later in :meth:`cite` or :meth:`to_html`. A version 1 dict (no
        ``version``) is read with today's names (:data:`TRACE_VERSION`)."""
        _check_trace(d)
        d = dict(d)
        if d.pop("version", 1) == 1:
            d["policy"] = _V1_POLICIES.get(d["policy"], d["policy"])
            d["steps"] = [
                {**s, "source": _V1_SOURCES.get(s["source"], s["source"])}
                for s in d.get("steps", [])
            ]
        d.pop("counts", None)
        d.pop("citations", None)
        steps = [
            TraceStep(
                index=s["index"],
                token_id=s["token_id"],
                text=s["text"],
                source=s["source"],
                candidates={k: Candidate(**c) for k, c in s.get("candidates", {}).items()},
                signals=dict(s.get("signals", {})),
                stats={k: dict(v) for k, v in s.get("stats", {}).items()},
                citation=list(s.get("citation", [])),
                logprob=s.get("logprob"),
                top_logprobs=[TopLogprob(**t) for t in s.get("top_logprobs", [])],
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


def comparable(data: dict[str, Any]) -> dict[str, Any]:
    """A trace's JSON data (:meth:`Trace.to_dict`, a server's or an adapter's ``trace``) less
    :data:`Trace.MEASURED`: see :meth:`Trace.comparable`."""
    return {k: v for k, v in data.items() if k not in Trace.MEASURED}


# ---------------------------------------------------------------- checking a trace's data
def _is(value: Any, kind: str) -> bool:
    """Whether ``value`` is JSON data of ``kind``: ``str``, ``int``, ``bool``, ``num`` (a
    number), ``num?`` (a number or null: NaN is written null in strict JSON), ``dict``,
    ``list``, ``any``."""
    if kind == "any":
        return True
    if kind == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "num?":
        return value is None or isinstance(value, (int, float))
    types = {"str": str, "int": int, "num": (int, float), "dict": dict, "list": list}
    return isinstance(value, types[kind])


#: Each record's fields and their kinds (:func:`_is`); the required ones are marked ``!``.
_TRACE_FIELDS = {
    "version": "int", "query": "str!", "policy": "str!", "model": "str", "options": "dict", "passages": "list",
    "warnings": "list", "steps": "list", "text": "str", "stop_reason": "str",
    "prompt_tokens": "dict", "timings": "dict", "speed": "dict", "counts": "dict",
    "citations": "list", "sampling": "dict",
}  # fmt: skip
_PASSAGE_FIELDS = {
    "rank": "int!", "text": "str!", "score": "num?", "n_tokens": "int", "kept": "bool",
    "cut": "bool", "metadata": "dict",
}  # fmt: skip
_STEP_FIELDS = {
    "index": "int!", "token_id": "int!", "text": "str!", "source": "str!", "candidates": "dict",
    "signals": "dict", "stats": "dict", "citation": "list", "logprob": "num?",
    "top_logprobs": "list",
}  # fmt: skip
_CANDIDATE_FIELDS = {"token_id": "int!", "text": "str!", "prob": "num?!"}
_TOP_FIELDS = {"token_id": "int!", "text": "str!", "logprob": "num?!"}


def _check_record(d: Any, fields: dict[str, str], where: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{where} is a {type(d).__name__}, not an object")
    for key in d:
        if key not in fields:
            raise ValueError(f"{where} has an unknown field {str(key)[:40]!r}")
    for key, spec in fields.items():
        kind, required = spec.rstrip("!"), spec.endswith("!")
        if key not in d:
            if required:
                raise ValueError(f"{where} has no {key!r}")
        elif not _is(d[key], kind):
            raise ValueError(f"{where}.{key} is a {type(d[key]).__name__}, not a {kind}")


def _check_trace(d: Any) -> None:
    """Raise a ``ValueError`` naming the first field of ``d`` (a :meth:`Trace.to_dict`) that
    a :class:`Trace` could not hold or its methods could not read."""
    _check_record(d, _TRACE_FIELDS, "trace")
    if d.get("version", 1) not in (1, TRACE_VERSION):
        raise ValueError(
            f"trace.version is {d['version']}: this library reads versions 1 and {TRACE_VERSION}"
        )
    for key, kind in (("warnings", "str"), ("prompt_tokens", "int"), ("timings", "num?")):
        values = d.get(key, [])
        for i, v in enumerate(values.values() if isinstance(values, dict) else values):
            if not _is(v, kind):
                raise ValueError(f"trace.{key}[{i}] is a {type(v).__name__}, not a {kind}")
    passages = d.get("passages", [])
    for i, p in enumerate(passages):
        _check_record(p, _PASSAGE_FIELDS, f"trace.passages[{i}]")
    kept = sum(1 for p in passages if p.get("kept", True))
    for i, s in enumerate(d.get("steps", [])):
        where = f"trace.steps[{i}]"
        _check_record(s, _STEP_FIELDS, where)
        for role, c in s.get("candidates", {}).items():
            _check_record(c, _CANDIDATE_FIELDS, f"{where}.candidates[{str(role)[:40]!r}]")
        for j, t in enumerate(s.get("top_logprobs", [])):
            _check_record(t, _TOP_FIELDS, f"{where}.top_logprobs[{j}]")
        for role, row in s.get("stats", {}).items():
            if not isinstance(row, dict) or not all(_is(v, "num?") for v in row.values()):
                raise ValueError(f"{where}.stats[{str(role)[:40]!r}] is not numbers by name")
        citation = s.get("citation", [])
        if not all(_is(v, "num") for v in citation):
            raise ValueError(f"{where}.citation holds something other than numbers")
        if citation and len(citation) != kept:
            raise ValueError(
                f"{where}.citation has {len(citation)} shares, not one per kept passage ({kept})"
            )


def _json_key(k: Any) -> str:
    """A dictionary key as ``json.dumps`` writes it."""
    if isinstance(k, str):
        return k
    if k is None or isinstance(k, (bool, int, float)):
        return json.dumps(k)
    return str(k)


def json_data(o: Any, finite: bool = False) -> Any:
    """``o`` with everything ``json`` cannot write converted (see :meth:`Trace.to_dict`): the
    one JSON conversion of the trace, the adapters' metadata, the remote client's bodies and
    the gates' saved state. ``finite=True``: a non-finite float becomes strict JSON (NaN ->
    None, +-inf -> +-1e308)."""
    if isinstance(o, float) and finite and not math.isfinite(o):
        return None if math.isnan(o) else (1e308 if o > 0 else -1e308)
    if o is None or isinstance(o, (str, bool, int, float)):
        return o
    if isinstance(o, dict):
        return {_json_key(k): json_data(v, finite) for k, v in o.items()}
    if isinstance(o, (list, tuple, set, frozenset)):
        return [json_data(v, finite) for v in o]
    torch = sys.modules.get("torch")  # a tensor is its (nested) list of numbers
    if torch is not None and isinstance(o, torch.Tensor):
        return json_data(o.tolist(), finite)
    if hasattr(o, "item"):  # numpy scalars and one-element arrays: the number
        try:
            return json_data(o.item(), finite)
        except (ValueError, TypeError, RuntimeError):
            pass
    if hasattr(o, "tolist"):  # other numpy arrays
        return json_data(o.tolist(), finite)
    return str(o)
