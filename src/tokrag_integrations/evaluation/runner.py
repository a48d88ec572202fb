"""Runners: noise sweep, misleading passages and token-level classification.

Each runner appends one JSON line per (item id, condition, policy) to ``records_path`` as
soon as it is known and skips the keys already in the file, so a run that was interrupted
(Ctrl-C, a killed job) continues where it stopped when started again with the same
arguments.

What is shared between policies: the passage mix of an (item, condition) (seeded, identical
for every policy); the prompt prefill (inside :func:`..engine.prefill.shared_prefill` every policy
that decodes the same pure / RAG context of the same item batch gets a copy of one prefilled
KV cache; the per-passage contexts of ``rag_token`` / ``rag_sequence`` are prefilled
separately); and the ``llm`` answer, which ignores passages and is decoded once per item and
reused for every condition. ``time_s`` in the records charges a policy the prefill it took
from another policy's decode (``prefill_reused_s``), so the policy that happens to run first
does not look dearer; it is still timed inside a shared run, and :mod:`.cost` measures cost
in isolation.

Policies are given as specs, ``name`` or ``name[key=value,...]`` (:mod:`.specs`), e.g.
``tokrag[min_fusion_layer=0]``: the normalised spec string is the record's ``policy`` and the
table label, and its options go to ``generate_batch(..., policy=name, **options)``. Every spec
is one more policy inside the shared prefill (two ``tokrag`` specs share it: probing does not
depend on the options).

Accuracy summaries carry 95 % percentile-bootstrap intervals (items resampled 2000 times,
fixed seed) per condition and for the mean over conditions, and the paired difference of each
policy to ``rag`` (the same item resample for both; :func:`compare_policies`).

Token level (:func:`run_token_level`) needs label-0 samples, positions where the pure model
predicts the gold token and RAG does not. With the 135M model these come from items the pure
model knows, so three sources are used:

* RGB (``rgb_en_fact``): the counterfactual conditions ``cf=0.5`` / ``cf=1`` (k = 2
  passages, counterfactual passages from the data); target: the evidence sentence.
* ConflictQA (``conflictqa_strategyqa``, yes/no): its positive and its counterfactual
  passage (which argues the opposite verdict) through the same ``cf=`` conditions (the noise
  conditions give the positive alone; there are no negatives); with ``target="auto"`` the
  target is the bare verdict "Yes" / "No" (``--target evidence``: the positive's first
  sentence).
* PopQA (``popqa``, no passages): :func:`.data.select_popular` keeps the top popularity
  quintile (``meta.pop_bin`` >= 4, 120 dev items), most popular first; :func:`.data.
  synthesize_popqa` gives each a supporting passage, one template sentence per relation
  (``meta.prop``) with the first gold answer ("The capital of Belarus is Minsk."), and a
  counterfactual passage, the same sentence with the first answer of another PopQA item of the
  same relation (from the whole file) that overlaps no gold answer and whose sentence covers
  none, drawn with a generator seeded by (seed, item id) (``counterfactual_answers`` holds it;
  no usable answer: no counterfactual). No negatives. Target: the bare first gold answer.
  The passages are synthetic one-liners, so this measures knowledge conflict, not retrieval.

Every record carries its item's ``source``; :func:`summarize_token_level` reports AUC (with a
95 % bootstrap interval, items resampled) and the label counts per source and pooled, and
:func:`pool_token_records` reads the records of several runs into one table.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..booleans import require_bool
from ..prompts import PromptBuilder
from .data import DEFAULT_RATIOS, DEFAULT_SEED, EvalItem, Mix, mix_counterfactuals, mix_passages
from .metrics import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    CI_LEVEL,
    auc,
    bootstrap_auc_ci,
    bootstrap_ci,
    cover_em,
    f1_score,
    first_yes_no,
    is_yes_no,
    macro_f1,
    mean_over_conditions,
    paired_bootstrap_diff,
)
from .specs import parse_specs, validate_specs

DEFAULT_POLICIES = ("llm", "rag", "tokrag", "cad", "adacad", "logprob", "entropy", "rag_token")
DEFAULT_CF_RATIOS = (0.0, 0.5, 1.0)
#: Condition name of policies that ignore passages: decoded once per item.
NO_PASSAGES = "none"

#: Tok-RAG scorers measured at token level when ``--scorers`` is not given: the defaults, each
#: corrected reading of docs/algorithm.md undone alone, all of them undone (the literal reading), DoLa's
#: own α = 0.1 for the rising token, the search start 10/32 of the depth (docs/algorithm.md, "Eq. 14"), a fixed
#: mid-depth l*, the Theorem-3 scorer and the authors' released rule. Labels are the specs
#: that reproduce them.
TOKRAG_CONFIGS: dict[str, dict[str, Any]] = {
    "tokrag": {},
    "tokrag[lens_norm=False,min_fusion_layer=0,plausibility_alpha=None]": {
        "lens_norm": False, "min_fusion_layer": 0, "plausibility_alpha": None,
    },
    "tokrag[min_fusion_layer=0]": {"min_fusion_layer": 0},
    "tokrag[plausibility_alpha=None]": {"plausibility_alpha": None},
    "tokrag[plausibility_alpha=0.1]": {"plausibility_alpha": 0.1},
    "tokrag[pr_skip=None]": {"pr_skip": None},
    "tokrag[min_fusion_layer=0.3125]": {"min_fusion_layer": 0.3125},
    "tokrag[fixed_layer=15]": {"fixed_layer": 15},
    "tokrag[scorer=distribution]": {"scorer": "distribution"},
    "tokrag[variant=reference]": {"variant": "reference"},
}


class RecordStore:
    """Append-only JSONL of per-item records keyed by (item, condition, policy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[tuple[str, str, str], dict[str, Any]] = {}
        if self.path.exists():
            with self.path.open(encoding="utf-8") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut by an interruption: that item is redone
                    self.records[self.key(r)] = r
            with self.path.open("rb") as fh:
                fh.seek(0, 2)
                cut = fh.tell() > 0 and (fh.seek(-1, 2), fh.read(1))[1] != b"\n"
            if cut:  # end the partial line so the next record starts on its own line
                with self.path.open("a", encoding="utf-8") as fh:
                    fh.write("\n")

    @staticmethod
    def key(r: dict[str, Any]) -> tuple[str, str, str]:
        return (str(r["item"]), str(r["condition"]), str(r["policy"]))

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def add(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.records[self.key(record)] = record

    def values(self) -> list[dict[str, Any]]:
        return list(self.records.values())


def _progress(total: int, initial: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, unit="answer")


def _default_decode(lm: Any, queries: list[str], passages: list[list[str]], **kw: Any) -> list[Any]:
    from ..api import generate_batch

    return generate_batch(lm, queries, passages, **kw)


def _run_generation(
    task: str,
    lm: Any,
    items: Sequence[EvalItem],
    conditions: Sequence[tuple[str, Callable[[EvalItem], Mix]]],
    *,
    policies: Sequence[str],
    records_path: str | Path,
    max_new_tokens: int,
    stop: Sequence[str],
    batch_size: int,
    policy_options: dict[str, dict[str, Any]] | None,
    keep_traces: bool,
    progress: bool,
    decode: Callable[..., list[Any]] | None,
) -> RecordStore:
    require_bool(keep_traces, "keep_traces")
    require_bool(progress, "progress")
    store = RecordStore(records_path)
    decode = decode or _default_decode
    from ..engine.prefill import shared_prefill

    options, pols = build_policies(policies, policy_options)
    # Probing policies first (the most probed roles first), so the prefill they leave behind
    # serves every other policy: a probed prefill serves a non-probing decode, not the reverse.
    order = sorted(pols, key=lambda p: -len(pols[p].probe_roles))
    no_passages = [p for p in order if not pols[p].uses_passages]
    with_passages = [p for p in order if pols[p].uses_passages]
    total = len(items) * (len(no_passages) + len(with_passages) * len(conditions))
    done = sum(1 for it in items for p in no_passages if (it.id, NO_PASSAGES, p) in store)
    done += sum(1 for it in items for p in with_passages for c, _ in conditions if (it.id, c, p) in store)
    bar = _progress(total, done, f"{task} ({lm_name(lm)})", progress)

    def run(policy: str, cond: str, batch: list[EvalItem], mixes: list[Mix]) -> None:
        t0 = time.perf_counter()
        results = decode(
            lm,
            [it.question for it in batch],
            [m.passages for m in mixes],
            policy=options[policy][0],
            max_new_tokens=max_new_tokens,
            stop=list(stop),
            **options[policy][1],
        )
        elapsed = time.perf_counter() - t0
        for it, mix, res in zip(batch, mixes, results, strict=True):
            rec: dict[str, Any] = {
                "task": task,
                "item": it.id,
                "condition": cond,
                "policy": policy,
                "text": res.text,
                "correct": cover_em(res.text, it.answers),
                "cf_repeat": cover_em(res.text, it.counterfactual_answers) if it.counterfactual_answers else None,
                "passages": mix.counts,
                "short": mix.short,
                "counts": res.trace.counts(),
                "stop_reason": res.stop_reason,
                # The prefill a policy took from another's decode is charged to it too, so
                # that the order of the policies does not make one of them look cheaper.
                "time_s": (elapsed + res.trace.timings.get("prefill_reused_s", 0.0)) / len(batch),
                "batch": len(batch),
            }
            if keep_traces:
                rec["trace"] = res.trace.to_dict()
            store.add(rec)
            bar.update(1)

    try:
        for policy in no_passages:  # ignores passages: once per item, valid for every condition
            todo = [it for it in items if (it.id, NO_PASSAGES, policy) not in store]
            for s in range(0, len(todo), batch_size):
                batch = todo[s : s + batch_size]
                run(policy, NO_PASSAGES, batch, [Mix([], [], {}, False) for _ in batch])
        for cond, mixer in conditions:
            todo = [it for it in items if any((it.id, cond, p) not in store for p in with_passages)]
            for s in range(0, len(todo), batch_size):
                batch = todo[s : s + batch_size]
                mixes = [mixer(it) for it in batch]
                # One prefill of each (item batch, condition) serves every policy.
                with shared_prefill():
                    for policy in with_passages:
                        sub = [(it, m) for it, m in zip(batch, mixes, strict=True) if (it.id, cond, policy) not in store]
                        if sub:
                            run(policy, cond, [it for it, _ in sub], [m for _, m in sub])
    finally:
        bar.close()
    return store


def policy_labels(policies: Sequence[str]) -> list[str]:
    """The normalised spec strings of ``policies`` (``tokrag[min_fusion_layer=0]`` ...), in
    order, duplicates dropped: the ``policy`` key of records and the rows of tables."""
    return [str(s) for s in parse_specs(list(policies))]


def build_policies(
    policies: Sequence[str], policy_options: dict[str, dict[str, Any]] | None = None
) -> tuple[dict[str, tuple[str, dict[str, Any]]], dict[str, Any]]:
    """Per spec label: (policy name, options) and the built policy. ``policy_options`` gives
    defaults per policy name (e.g. ``{"cad": {"alpha": 0.3}}``) or per label; a spec's own
    options override them."""
    from ..policies import get_policy

    policy_options = policy_options or {}
    options: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in parse_specs(list(policies)):
        label = str(spec)
        opts = {**policy_options.get(spec.name, {}), **policy_options.get(label, {}), **spec.options}
        options[label] = (spec.name, opts)
    return options, {label: get_policy(name, **opts) for label, (name, opts) in options.items()}


def lm_name(lm: Any) -> str:
    return str(getattr(lm, "name", "model"))


def run_noise_sweep(
    lm: Any,
    items: Sequence[EvalItem],
    *,
    records_path: str | Path,
    policies: Sequence[str] = DEFAULT_POLICIES,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    k: int = 5,
    seed: int = DEFAULT_SEED,
    max_new_tokens: int = 24,
    stop: Sequence[str] = ("\n",),
    batch_size: int = 1,
    policy_options: dict[str, dict[str, Any]] | None = None,
    keep_traces: bool = True,
    progress: bool = True,
    decode: Callable[..., list[Any]] | None = None,
) -> dict[str, Any]:
    """Table 1 protocol: accuracy (cover EM) per policy and noise ratio. Returns the summary."""
    conditions = [(f"{r:g}", (lambda it, r=r: mix_passages(it, r, k=k, seed=seed))) for r in ratios]
    store = _run_generation(
        "noise", lm, items, conditions, policies=policies, records_path=records_path,
        max_new_tokens=max_new_tokens, stop=stop, batch_size=batch_size, policy_options=policy_options,
        keep_traces=keep_traces, progress=progress, decode=decode,
    )
    return summarize_accuracy(store.values(), items, policy_labels(policies), [c for c, _ in conditions])


def run_misleading(
    lm: Any,
    items: Sequence[EvalItem],
    *,
    records_path: str | Path,
    policies: Sequence[str] = DEFAULT_POLICIES,
    cf_ratios: Sequence[float] = DEFAULT_CF_RATIOS,
    k: int = 2,
    seed: int = DEFAULT_SEED,
    max_new_tokens: int = 24,
    stop: Sequence[str] = ("\n",),
    batch_size: int = 1,
    policy_options: dict[str, dict[str, Any]] | None = None,
    keep_traces: bool = True,
    progress: bool = True,
    decode: Callable[..., list[Any]] | None = None,
) -> dict[str, Any]:
    """Positives mixed with counterfactual passages (ratio 1.0 = counterfactuals only) on the
    items that have counterfactuals: accuracy and the rate of answers repeating the
    counterfactual answer."""
    items = [it for it in items if it.counterfactuals]
    if not items:
        raise ValueError("no item has counterfactual passages: use rgb_en_fact or conflictqa_strategyqa data")
    conditions = [(f"cf={r:g}", (lambda it, r=r: mix_counterfactuals(it, r, k=k, seed=seed))) for r in cf_ratios]
    store = _run_generation(
        "misleading", lm, items, conditions, policies=policies, records_path=records_path,
        max_new_tokens=max_new_tokens, stop=stop, batch_size=batch_size, policy_options=policy_options,
        keep_traces=keep_traces, progress=progress, decode=decode,
    )
    return summarize_accuracy(store.values(), items, policy_labels(policies), [c for c, _ in conditions])


def _index(records: Iterable[dict[str, Any]], ids: set[str]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["policy"], r["condition"], r["item"]): r for r in records if r["item"] in ids}


def _record(index: dict[tuple[str, str, str], dict[str, Any]], policy: str, condition: str,
            item_id: str) -> dict[str, Any] | None:
    """The record of ``policy`` on ``item_id`` under ``condition``; ``llm`` records (condition
    ``none``) stand for every condition."""
    return index.get((policy, condition, item_id)) or index.get((policy, NO_PASSAGES, item_id))


def item_matrix(
    index: dict[tuple[str, str, str], dict[str, Any]],
    items: Sequence[EvalItem],
    policy: str,
    conditions: Sequence[str],
    key: str = "correct",
) -> list[list[float]]:
    """Rows = items, columns = conditions: 100 if the record's ``key`` is true, 0 if false,
    NaN where there is no record or the value is None. ``llm`` records (condition ``none``)
    fill every condition."""

    def cell(it: EvalItem, c: str) -> float:
        r = _record(index, policy, c, it.id)
        v = None if r is None else r.get(key)
        return math.nan if v is None else 100.0 * bool(v)

    return [[cell(it, c) for c in conditions] for it in items]


def _column_mean(matrix: list[list[float]], j: int) -> float:
    vals = [row[j] for row in matrix if not math.isnan(row[j])]
    return sum(vals) / len(vals) if vals else math.nan


def _figures(matrix: list[list[float]], conditions: Sequence[str], seed: int) -> dict[str, Any]:
    """Per condition: mean and bootstrap CI; over conditions: mean and CI (items resampled)."""
    return {
        "by_condition": {c: _column_mean(matrix, j) for j, c in enumerate(conditions)},
        "ci": {c: list(bootstrap_ci([[row[j]] for row in matrix], seed=seed)) for j, c in enumerate(conditions)},
        "mean": mean_over_conditions(matrix),
        "mean_ci": list(bootstrap_ci(matrix, seed=seed)),
    }


def compare_policies(
    records: Iterable[dict[str, Any]],
    items: Sequence[EvalItem],
    a: str,
    b: str,
    conditions: Sequence[str],
    key: str = "correct",
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """Policy ``a`` − policy ``b`` of the mean over conditions of ``key`` (percent) on the same
    items, with the paired bootstrap 95 % interval: ``{"diff": d, "ci": [lo, hi]}``. "a is
    not below b within the 95 % interval" reads ``ci[1] >= 0``."""
    index = _index(records, {it.id for it in items})
    return paired_bootstrap_diff(
        item_matrix(index, items, a, conditions, key), item_matrix(index, items, b, conditions, key), seed=seed
    )


def summarize_accuracy(
    records: Iterable[dict[str, Any]],
    items: Sequence[EvalItem],
    policies: Sequence[str],
    conditions: Sequence[str],
    baseline: str = "rag",
    seed: int = BOOTSTRAP_SEED,
) -> dict[str, Any]:
    """Accuracy / counterfactual-repeat rate / time per policy and condition (percent), with
    95 % bootstrap intervals (items resampled, :data:`BOOTSTRAP_RESAMPLES` times, fixed
    seed) per condition and for the mean over conditions, and the paired difference of every
    policy to ``baseline`` (when it was run).

    ``llm`` records (condition ``none``) count for every condition. Only the given items
    enter the figures, so a records file shared by larger runs does not leak in.
    """
    records = list(records)
    items = list({it.id: it for it in items}.values())
    ids = {it.id for it in items}
    index = _index(records, ids)
    out: dict[str, Any] = {
        "policies": list(policies),
        "conditions": list(conditions),
        "n_items": len(ids),
        "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "level": CI_LEVEL, "unit": "item"},
    }
    for key in ("accuracy", "cf_repeat"):
        field = "correct" if key == "accuracy" else "cf_repeat"
        figs = {p: _figures(item_matrix(index, items, p, conditions, field), conditions, seed) for p in policies}
        out[key] = {p: f["by_condition"] for p, f in figs.items()}
        out[f"{key}_ci"] = {p: f["ci"] for p, f in figs.items()}
        out[f"{key}_mean"] = {p: f["mean"] for p, f in figs.items()}
        out[f"{key}_mean_ci"] = {p: f["mean_ci"] for p, f in figs.items()}
    out["n"] = {
        p: {c: sum(1 for row in item_matrix(index, items, p, [c]) if not math.isnan(row[0])) for c in conditions}
        for p in policies
    }
    if baseline in policies:
        out["paired_baseline"] = baseline
        out["paired"] = {
            p: {k: compare_policies(records, items, p, baseline, conditions, f, seed) for k, f in
                (("accuracy", "correct"), ("cf_repeat", "cf_repeat"))}
            for p in policies if p != baseline
        }
    yes_no = [it for it in items if is_yes_no(it.answers)]
    if yes_no:
        out.update(_verdict_figures(index, yes_no, policies, conditions, seed))
    out["mean_tokens"] = {p: _mean_tokens(index, items, p, conditions) for p in policies}
    if baseline in policies:
        out["length_ratio"] = {
            p: _ratio(_mean_tokens(index, items, p, conditions, paired_with=baseline),
                      _mean_tokens(index, items, baseline, conditions, paired_with=p))
            for p in policies if p != baseline
        }
    out["mean_time_s"] = _mean_times(index, items, policies, conditions)
    out["mean_passages"], out["items_short"] = _passage_counts(records, ids, conditions)
    return out


def _verdict_figures(index: dict[tuple[str, str, str], dict[str, Any]], items: Sequence[EvalItem],
                     policies: Sequence[str], conditions: Sequence[str], seed: int) -> dict[str, Any]:
    """Yes/no items: the share of answers that state a verdict (a standalone yes or no,
    :func:`.metrics.first_yes_no`) and the accuracy among those answers, per policy and
    condition (percent, 95 % bootstrap intervals over items)."""
    verdicts = {}
    for key, r in index.items():
        stated = first_yes_no(r["text"]) is not None
        verdicts[key] = {**r, "verdict": stated, "verdict_correct": r["correct"] if stated else None}
    out: dict[str, Any] = {"n_yes_no_items": len(items)}
    for key in ("verdict", "verdict_correct"):
        figs = {p: _figures(item_matrix(verdicts, items, p, conditions, key), conditions, seed) for p in policies}
        name = "verdict_rate" if key == "verdict" else "verdict_accuracy"
        out[name] = {p: f["by_condition"] for p, f in figs.items()}
        out[f"{name}_ci"] = {p: f["ci"] for p, f in figs.items()}
        out[f"{name}_mean"] = {p: f["mean"] for p, f in figs.items()}
        out[f"{name}_mean_ci"] = {p: f["mean_ci"] for p, f in figs.items()}
    return out


def _tokens(r: dict[str, Any] | None) -> int | None:
    return None if r is None or "counts" not in r else sum(r["counts"].values())


def _mean_tokens(index: dict[tuple[str, str, str], dict[str, Any]], items: Sequence[EvalItem], policy: str,
                 conditions: Sequence[str], paired_with: str | None = None) -> float:
    """Mean generated tokens per answer; with ``paired_with``, only over the (item, condition)
    cells both policies answered."""
    lengths = []
    for c in conditions:
        for it in items:
            n = _tokens(_record(index, policy, c, it.id))
            if n is not None and (paired_with is None or _tokens(_record(index, paired_with, c, it.id)) is not None):
                lengths.append(n)
    return sum(lengths) / len(lengths) if lengths else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _mean_times(index: dict[tuple[str, str, str], dict[str, Any]], items: Sequence[EvalItem],
                policies: Sequence[str], conditions: Sequence[str]) -> dict[str, float]:
    secs: dict[str, float] = {}
    for p in policies:
        rs = [_record(index, p, c, it.id) for c in conditions for it in items]
        times = [r["time_s"] for r in rs if r is not None]
        secs[p] = sum(times) / len(times) if times else math.nan
    return secs


def _passage_counts(records: list[dict[str, Any]], ids: set[str], conditions: Sequence[str]) -> tuple[dict[str, Any], dict[str, int]]:
    passages: dict[str, dict[str, float]] = {}
    short: dict[str, int] = {}
    for c in conditions:
        first = {r["item"]: r for r in records if r["item"] in ids and r["condition"] == c}
        short[c] = sum(1 for r in first.values() if r.get("short"))
        if first:
            passages[c] = {
                kind: round(sum(r["passages"].get(kind, 0) for r in first.values()) / len(first), 2)
                for kind in ("pos", "neg", "cf")
            }
    return passages, short


# --------------------------------------------------------------------------- token level
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


#: Gold continuations: the answer-bearing sentence, the bare answer, or "auto" (the bare
#: answer for yes/no items and PopQA items with synthetic passages, else the sentence).
TARGETS = ("auto", "evidence", "answer")


def evidence_sentence(item: EvalItem) -> str:
    """The first sentence of a positive passage that contains a gold answer (case-insensitive),
    else the first sentence of the first positive, else the first answer. Yes/no items: the
    positive's first sentence (it states the verdict; "yes" would match inside "eyes")."""
    answers = [] if is_yes_no(item.answers) else [a.lower() for a in item.answers if a.strip()]
    sentences = [s.strip() for p in item.positives for s in _SENTENCE.split(p) if s.strip()]
    for s in sentences:
        if any(a in s.lower() for a in answers):
            return s
    if sentences:
        return sentences[0]
    return item.answers[0] if item.answers else ""


def target_kind(item: EvalItem, target: str = "auto") -> str:
    """``"answer"`` or ``"evidence"`` for this item (``"auto"`` decides per item)."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if target != "auto":
        return target
    return "answer" if is_yes_no(item.answers) or item.meta.get("synthetic_passages") else "evidence"


def gold_target(tokenizer: Any, item: EvalItem, target: str = "evidence", max_tokens: int = 32) -> list[int]:
    """Token ids of the gold continuation fed after the question.

    ``"answer"``: the first gold answer (capitalised, as a reply would open: "Yes", "Minsk");
    ``"evidence"``: the answer-bearing sentence of a positive passage (the paper traverses
    gold sentences), cut to ``max_tokens``; ``"auto"``: :func:`target_kind`.
    """
    kind = target_kind(item, target)
    text = item.answers[0].strip() if kind == "answer" and item.answers else ""
    if kind == "evidence":
        text = evidence_sentence(item)
    text = text[:1].upper() + text[1:]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens] if text else []


def scorer_configs(specs: str | Sequence[str] | None) -> dict[str, dict[str, Any]]:
    """Token scorers from specs (``"tokrag,tokrag[min_fusion_layer=0,lens_norm=false]"``):
    label -> ``TokRAG`` options. None: :data:`TOKRAG_CONFIGS`. Each spec must name ``tokrag``
    and its options must build ``TokRAG(**options)``; else ValueError (one sentence)."""
    if specs is None:
        return dict(TOKRAG_CONFIGS)
    from ..policies.tokrag import TokRAG

    parsed = parse_specs(specs)
    validate_specs(parsed, ["tokrag"], lambda name, **o: TokRAG(**o))
    return {str(sp): dict(sp.options) for sp in parsed}


def _token_conditions(ratios: Sequence[float], cf_ratios: Sequence[float], k: int, cf_k: int, seed: int) -> list[tuple[str, Callable[[EvalItem], Mix]]]:
    conds: list[tuple[str, Callable[[EvalItem], Mix]]] = [
        (f"{r:g}", (lambda it, r=r: mix_passages(it, r, k=k, seed=seed))) for r in ratios
    ]
    conds += [(f"cf={r:g}", (lambda it, r=r: mix_counterfactuals(it, r, k=cf_k, seed=seed))) for r in cf_ratios]
    return conds


def _token_samples(lm: Any, builder: Any, walker: Any, scorers: dict[str, Any], question: str,
                   passages: list[str], target: list[int]) -> list[dict[str, Any]]:
    """Teacher-force ``target`` after the question in the pure and RAG contexts; one sample
    per position where exactly one of them predicts the gold token."""
    import warnings

    from ..engine.loop import teacher_force
    from ..policies.selection import entropy_margin, logprob_margin

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = builder.build(question, passages, max_new_tokens=len(target) + 1)
    if not plan.has_passages:
        return []
    samples = []
    with lm.lock:
        for _, i, views in teacher_force(lm, [plan], walker, [target]):
            pure, rag = views["pure"], views["rag"]
            a = int(pure.logits.argmax().item())
            b = int(rag.logits.argmax().item())
            if (a == target[i]) == (b == target[i]):
                continue
            scores = {name: _safe_score(sc, pure, rag) for name, sc in scorers.items()}
            scores["logprob"] = logprob_margin(pure.probs, rag.probs)
            scores["entropy"] = entropy_margin(pure.probs, rag.probs)
            samples.append({"pos": i, "label": int(b == target[i]), "scores": scores})
    return samples


def run_token_level(
    lm: Any,
    items: Sequence[EvalItem],
    *,
    records_path: str | Path,
    ratios: Sequence[float] = (0.0, 0.6, 1.0),
    cf_ratios: Sequence[float] = (0.5, 1.0),
    k: int = 5,
    cf_k: int = 2,
    seed: int = DEFAULT_SEED,
    tokrag_configs: dict[str, dict[str, Any]] | None = None,
    target: str = "evidence",
    max_target_tokens: int = 32,
    progress: bool = True,
) -> dict[str, Any]:
    """Table 3 protocol on gold continuations (seed 000, Section 4.1).

    For every (item, passage condition) the gold continuation (:func:`gold_target`: the
    answer-bearing evidence sentence, the bare answer, or per item with ``"auto"``) is fed
    token by token after the question (teacher forcing) to both the pure and the RAG
    context. Where exactly one of them predicts the gold next token there is a sample: label
    1 if RAG is the one (benefit outweighs detriment), 0 if the pure LLM is. Each scorer gives
    a number that is > 0 when it would keep the RAG token: Tok-RAG's cos(w_RAG, w_IR) −
    cos(w_RAG, w_LLM) for each option set in ``tokrag_configs`` (label -> ``TokRAG``
    options; default :data:`TOKRAG_CONFIGS`, see :func:`scorer_configs`), the top-1 log-prob
    margin and the entropy margin.

    Label-0 samples need items the pure model knows: counterfactual conditions (``cf=``) of
    RGB and ConflictQA (yes/no: target "Yes"/"No" with ``target="auto"``; the opposite
    passage argues the other verdict), and popular PopQA items with synthetic passages
    (:func:`.data.synthesize_popqa`, :func:`.data.select_popular`; target = the bare answer).
    Records carry the item's ``source`` so that pooled summaries report each source.
    """
    from ..policies.tokrag import TokRAG

    require_bool(progress, "progress")
    configs = dict(TOKRAG_CONFIGS if tokrag_configs is None else tokrag_configs)
    scorers = {name: TokRAG(**opts) for name, opts in configs.items()}
    for sc in scorers.values():
        sc.prepare(lm)
    walker = TokRAG()
    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    store = RecordStore(records_path)
    conds = _token_conditions(ratios, cf_ratios, k, cf_k, seed)
    units = [(it, c, m) for it in items for c, m in conds if not c.startswith("cf=") or it.counterfactuals]
    bar = _progress(len(units), sum(1 for it, c, _ in units if (it.id, c, "token") in store), "token level", progress)
    try:
        for it, cond, mixer in units:
            if (it.id, cond, "token") in store:
                continue
            mix = mixer(it)
            ids = gold_target(lm.tokenizer, it, target, max_target_tokens)
            samples = _token_samples(lm, builder, walker, scorers, it.question, mix.passages, ids) if mix.passages and ids else []
            store.add({
                "task": "token", "item": it.id, "condition": cond, "policy": "token", "source": it.source,
                "samples": samples, "n_target_tokens": len(ids), "target": target_kind(it, target),
                "passages": mix.counts,
            })
            bar.update(1)
    finally:
        bar.close()
    ids_ = {it.id for it in items}
    return summarize_token_level([r for r in store.values() if r["item"] in ids_])


def _safe_score(scorer: Any, pure: Any, rag: Any) -> float:
    try:
        return float(scorer.score(pure, rag))
    except (ValueError, RuntimeError):
        return math.nan


def pool_token_records(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Token-level records of several runs (records JSONL files) in one list, each tagged with
    ``run`` (its file's stem); a record without a ``source`` (older runs) gets the stem as its
    source. Records of the same item in two files are all kept (e.g. two targets)."""
    out: list[dict[str, Any]] = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"Records file not found: {p}.")
        for r in RecordStore(p).values():
            if r.get("task", "token") == "token" and "samples" in r:
                out.append({**r, "source": r.get("source") or p.stem, "run": p.stem})
    return out


def _scorer_names(samples: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for smp in samples:
        names += [n for n in smp["scores"] if n not in names]
    return names


def _scorer_figures(samples: list[tuple[str, dict[str, Any]]], name: str, seed: int) -> dict[str, Any]:
    """AUC (with its 95 % interval, samples resampled grouped by item), F1, macro-F1 and the
    label counts of the samples this scorer scored."""
    kept = [(g, smp["scores"].get(name, math.nan), smp["label"]) for g, smp in samples]
    kept = [(g, x, y) for g, x, y in kept if x is not None and not math.isnan(x)]
    xs, ys, gs = [x for _, x, _ in kept], [y for _, _, y in kept], [g for g, _, _ in kept]
    preds = [int(x >= 0) for x in xs]
    lo, hi = bootstrap_auc_ci(xs, ys, gs, seed=seed) if xs else (math.nan, math.nan)
    return {
        "auc": 100 * auc(xs, ys) if xs else math.nan,
        "auc_ci": [100 * lo, 100 * hi],
        "f1": 100 * f1_score(preds, ys) if xs else math.nan,
        "macro_f1": 100 * macro_f1(preds, ys) if xs else math.nan,
        "n": len(xs),
        "n_label1": sum(ys),
        "n_label0": len(ys) - sum(ys),
    }


def _token_figures(records: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    samples = [(f"{r.get('source', '')}/{r['item']}", smp) for r in records for smp in r.get("samples", [])]
    labels = [smp["label"] for _, smp in samples]
    return {
        "n_samples": len(samples),
        "n_benefit": sum(labels),
        "n_label1": sum(labels),
        "n_label0": len(labels) - sum(labels),
        "n_records": len(records),
        "scorers": {n: _scorer_figures(samples, n, seed) for n in _scorer_names([s for _, s in samples])},
    }


def summarize_token_level(records: Iterable[dict[str, Any]], seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """AUC (95 % bootstrap interval, items resampled) and F1 (decision: score >= 0 keeps RAG)
    per scorer, with the label counts (n label 1 / n label 0): pooled over all records, and
    per ``source`` under ``"sources"``."""
    records = list(records)
    out = _token_figures(records, seed)
    by_source: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_source.setdefault(str(r.get("source") or "items"), []).append(r)
    out["sources"] = {src: _token_figures(rs, seed) for src, rs in sorted(by_source.items())}
    out["bootstrap"] = {"resamples": BOOTSTRAP_RESAMPLES, "seed": seed, "level": CI_LEVEL, "unit": "item"}
    return out
