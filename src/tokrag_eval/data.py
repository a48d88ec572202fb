"""Evaluation items (``shared/data`` JSONL format) and deterministic passage mixing."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

DEFAULT_RATIOS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
DEFAULT_SEED = 20240917


@dataclass
class EvalItem:
    """One question with its gold answers and candidate passages."""

    id: str
    question: str
    answers: list[str]
    positives: list[str] = field(default_factory=list)
    negatives: list[str] = field(default_factory=list)
    counterfactuals: list[str] = field(default_factory=list)
    counterfactual_answers: list[str] = field(default_factory=list)
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    popularity: float | None = None


_REQUIRED = ("id", "question", "answers")


def load_items(path: str | Path, limit: int | None = None) -> list[EvalItem]:
    """Read a JSONL evaluation set; ``limit`` keeps the first n items (file order).
    FileNotFoundError / ValueError (naming the line): a missing file, bad JSON or field."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"Evaluation data not found: {p}. Pass a JSONL file (format: shared/data/README.md)."
        )
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    items: list[EvalItem] = []
    with p.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n} is not valid JSON: {e}") from e
            missing = [k for k in _REQUIRED if k not in d]
            if missing:
                raise ValueError(f"{p}:{n} lacks required field(s) {missing}")
            items.append(
                EvalItem(
                    id=str(d["id"]),
                    question=d["question"],
                    answers=list(d["answers"]),
                    positives=list(d.get("positives") or []),
                    negatives=list(d.get("negatives") or []),
                    counterfactuals=list(d.get("counterfactuals") or []),
                    counterfactual_answers=list(d.get("counterfactual_answers") or []),
                    source=d.get("source", ""),
                    meta=d.get("meta") or {},
                    popularity=d.get("popularity"),
                )
            )
            if limit is not None and len(items) >= limit:
                break
    return items


def _rng(seed: int, *parts: Any) -> random.Random:
    """A generator that depends only on (seed, parts): identical for every policy and run."""
    key = "\x1f".join([str(seed), *map(str, parts)]).encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


@dataclass
class Mix:
    """The passages of one (item, condition), ranked as given to every policy."""

    passages: list[str]
    kinds: list[str]  # "pos" | "neg" | "cf" per passage
    wanted: dict[str, int]
    short: bool  # the item lacked enough passages of some kind

    @property
    def counts(self) -> dict[str, int]:
        return {k: self.kinds.count(k) for k in ("pos", "neg", "cf")}


def _mix(item: EvalItem, want: dict[str, int], seed: int, condition: str) -> Mix:
    rng = _rng(seed, item.id, condition)
    pools = {"pos": item.positives, "neg": item.negatives, "cf": item.counterfactuals}
    chosen: list[tuple[str, str]] = []
    short = False
    for kind in ("pos", "neg", "cf"):
        n = want.get(kind, 0)
        pool = pools[kind]
        if n > len(pool):
            short = True
        take = rng.sample(range(len(pool)), min(n, len(pool)))
        chosen += [(pool[i], kind) for i in take]
    rng.shuffle(chosen)
    return Mix([t for t, _ in chosen], [k for _, k in chosen], dict(want), short)


def _check(ratio: float, k: int, what: str) -> float:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{what} ratio must be in [0, 1], got {ratio}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return ratio


def mix_passages(item: EvalItem, ratio: float, k: int = 5, seed: int = DEFAULT_SEED) -> Mix:
    """Table 1 protocol: k passages, round((1 − ratio)·k) positives, the rest hard negatives
    (fewer when a pool is too small: ``Mix.short``), sampled and shuffled with a generator
    seeded by (seed, item id, ratio), so every policy and run sees the same list."""
    n_pos = round((1 - _check(ratio, k, "noise")) * k)
    return _mix(item, {"pos": n_pos, "neg": k - n_pos}, seed, f"noise={ratio:g}/k={k}")


def mix_counterfactuals(
    item: EvalItem, cf_ratio: float, k: int = 2, seed: int = DEFAULT_SEED
) -> Mix:
    """Misleading passages: k passages, round(cf_ratio·k) counterfactuals, the rest positives."""
    n_cf = round(_check(cf_ratio, k, "counterfactual") * k)
    return _mix(item, {"pos": k - n_cf, "cf": n_cf}, seed, f"cf={cf_ratio:g}/k={k}")


Conditions = list[tuple[str, Callable[[EvalItem], Mix]]]


def noise_conditions(ratios: Sequence[float], k: int, seed: int) -> Conditions:
    """(label ``"0.4"``, mixer) per noise ratio (:func:`mix_passages`)."""
    return [(f"{r:g}", partial(mix_passages, ratio=r, k=k, seed=seed)) for r in ratios]


def cf_conditions(cf_ratios: Sequence[float], k: int, seed: int) -> Conditions:
    """(label ``"cf=0.5"``, mixer) per counterfactual ratio (:func:`mix_counterfactuals`)."""
    return [
        (f"cf={r:g}", partial(mix_counterfactuals, cf_ratio=r, k=k, seed=seed)) for r in cf_ratios
    ]


# --------------------------------------------------------------------------- PopQA passages
#: One sentence per PopQA relation (``meta.prop``); {s} = subject, {o} = object (answer).
POPQA_TEMPLATES: dict[str, str] = {
    "author": "{s} was written by {o}.",
    "screenwriter": "The screenwriter of {s} was {o}.",
    "mother": "The mother of {s} is {o}.",
    "producer": "{s} was produced by {o}.",
    "place of birth": "{s} was born in {o}.",
    "genre": "The genre of {s} is {o}.",
    "father": "The father of {s} is {o}.",
    "sport": "{s} plays {o}.",
    "composer": "The composer of {s} was {o}.",
    "country": "{s} is located in {o}.",
    "director": "{s} was directed by {o}.",
    "religion": "The religion of {s} is {o}.",
    "occupation": "The occupation of {s} is {o}.",
    "capital of": "{s} is the capital of {o}.",
    "capital": "The capital of {s} is {o}.",
    "color": "The color of {s} is {o}.",
}


def popqa_passage(item: EvalItem, answer: str) -> str:
    """The template sentence of the item's relation stating ``answer`` (a relation without a
    template: 'The answer to "<question>" is <answer>.')."""
    template = POPQA_TEMPLATES.get(str(item.meta.get("prop", "")))
    subj = str(item.meta.get("subj") or "")
    if template is None or not subj:
        return f'The answer to "{item.question}" is {answer}.'
    text = template.format(s=subj, o=answer)
    return text[:1].upper() + text[1:]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _wrong_answer(item: EvalItem, pool: list[EvalItem], seed: int) -> str | None:
    """Another item's first answer of the same relation that is none of this item's answers
    (neither contains nor is contained in one, and the counterfactual sentence built with it
    covers no gold answer: "The mother of Jesus is X." covers the alias "Mother of Jesus"),
    drawn with a generator seeded by (seed, item id); None when there is no such answer."""
    from .metrics import cover_em

    gold = [_norm(a) for a in item.answers if a.strip()]
    prop = item.meta.get("prop")
    cands = sorted(
        {o.answers[0] for o in pool if o.id != item.id and o.meta.get("prop") == prop and o.answers}
    )
    cands = [
        c for c in cands if c.strip() and not any(g in _norm(c) or _norm(c) in g for g in gold)
    ]
    cands = [c for c in cands if not cover_em(popqa_passage(item, c), item.answers)]
    return _rng(seed, item.id, "popqa-counterfactual").choice(cands) if cands else None


def synthesize_popqa(
    items: list[EvalItem], *, pool: list[EvalItem] | None = None, seed: int = DEFAULT_SEED
) -> list[EvalItem]:
    """PopQA items (no passages) with synthetic passages for the token-level protocol:
    ``positives`` = [the relation's template sentence with the first gold answer] ("The
    capital of Belarus is Minsk."); ``counterfactuals`` = [the same sentence with another
    item's answer of the same relation from ``pool``, :func:`_wrong_answer`], or none when
    there is no usable one; ``counterfactual_answers`` = [that answer]; no negatives.
    """
    pool = items if pool is None else pool
    out = []
    for it in items:
        if not it.answers:
            continue
        wrong = _wrong_answer(it, pool, seed)
        out.append(
            replace(
                it,
                answers=list(it.answers),
                positives=[popqa_passage(it, it.answers[0])],
                negatives=[],
                counterfactuals=[popqa_passage(it, wrong)] if wrong else [],
                counterfactual_answers=[wrong] if wrong else [],
                meta={**it.meta, "synthetic_passages": True},
            )
        )
    return out


def select_popular(items: list[EvalItem], min_pop_bin: int = 4) -> list[EvalItem]:
    """Items whose ``meta.pop_bin`` (popularity quintile 0–4) is at least ``min_pop_bin``,
    most popular (``popularity``) first; items without a bin count as bin 0."""
    keep = [it for it in items if int(it.meta.get("pop_bin") or 0) >= min_pop_bin]
    return sorted(keep, key=lambda it: -(it.popularity or 0.0))


def is_popqa(items: list[EvalItem]) -> bool:
    """PopQA-style items: no passages at all, each with a relation in ``meta.prop``."""
    return bool(items) and all(
        not (it.positives or it.negatives or it.counterfactuals) and "prop" in it.meta
        for it in items
    )
