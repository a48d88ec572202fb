"""Token-level classification (Table 3 protocol): gold continuations teacher-forced in the
pure and RAG contexts, the samples where exactly one of them predicts the gold token, and the
AUC / F1 of each scorer on them.

Label-0 samples (the pure model right, RAG wrong) need items the pure model knows: RGB's and
ConflictQA's counterfactual conditions (``cf=``; ConflictQA's yes/no target is the bare
verdict with ``target="auto"``), and PopQA's most popular items with synthetic passages
(:func:`.data.select_popular`, :func:`.data.synthesize_popqa`; target: the bare gold answer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokrag_integrations.config import require_bool
from tokrag_integrations.prompts import PromptBuilder

from .data import DEFAULT_SEED, EvalItem, cf_conditions, noise_conditions
from .metrics import (
    BOOTSTRAP_SEED,
    auc,
    bootstrap_auc_ci,
    bootstrap_settings,
    f1_score,
    is_yes_no,
    macro_f1,
)
from .records import RecordStore, progress_bar
from .specs import PolicySpec, parse_specs, validate_specs

__all__ = [
    "DEFAULT_SCORER_CONFIGS",
    "TARGETS",
    "evidence_sentence",
    "gold_target",
    "pool_token_records",
    "run_token_level",
    "scorer_configs",
    "summarize_token_level",
    "target_kind",
]


def _configs(specs: Iterable[PolicySpec]) -> dict[str, dict[str, Any]]:
    """Spec label -> ``TokRAG`` options (``"policy"`` names the authors' rule)."""
    return {
        str(sp): {**({"policy": sp.name} if sp.name != "tokrag" else {}), **sp.options}
        for sp in specs
    }


#: Tok-RAG scorers measured at token level when ``--scorers`` is not given (docs/algorithm.md):
#: the defaults, each corrected reading undone alone and all together, DoLa's α = 0.1, the
#: search start 10/32 of the depth, a fixed l*, the Theorem-3 scorer and the authors' rule.
DEFAULT_SCORER_CONFIGS = _configs(
    parse_specs(
        "tokrag,tokrag[lens_norm=False,min_fusion_layer=0,plausibility_alpha=None],"
        "tokrag[min_fusion_layer=0],tokrag[plausibility_alpha=None],tokrag[plausibility_alpha=0.1],"
        "tokrag[pr_skip=None],tokrag[min_fusion_layer=0.3125],tokrag[fixed_layer=15],"
        "tokrag[scorer=distribution],tokrag_authors"
    )
)


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
    return (
        "answer" if is_yes_no(item.answers) or item.meta.get("synthetic_passages") else "evidence"
    )


def gold_target(
    tokenizer: Any, item: EvalItem, target: str = "evidence", max_tokens: int = 32
) -> list[int]:
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
    label -> ``TokRAG`` options (``"policy": "tokrag_authors"`` for the authors' rule). None:
    :data:`DEFAULT_SCORER_CONFIGS`. Each spec must name ``tokrag`` or ``tokrag_authors`` with options
    its policy takes; else ValueError (one sentence)."""
    if specs is None:
        return dict(DEFAULT_SCORER_CONFIGS)
    from tokrag_integrations.policies import get_policy

    parsed = parse_specs(specs)
    validate_specs(parsed, ["tokrag", "tokrag_authors"], get_policy)
    return _configs(parsed)


def _token_samples(
    lm: Any,
    builder: Any,
    walker: Any,
    scorers: dict[str, Any],
    question: str,
    passages: list[str],
    target: list[int],
) -> list[dict[str, Any]]:
    """Teacher-force ``target`` after the question in the pure and RAG contexts; one sample
    per position where exactly one of them predicts the gold token."""
    import warnings

    from tokrag_integrations.engine.loop import teacher_force
    from tokrag_integrations.engine.view import make_lens
    from tokrag_integrations.policies.selection import entropy_margin, logprob_margin

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
            scores = {
                name: _safe_score(sc, pure, rag, make_lens(lm)) for name, sc in scorers.items()
            }
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

    For every (item, passage condition) the gold continuation (:func:`gold_target`) is fed
    token by token after the question (teacher forcing) to the pure and the RAG context.
    Where exactly one of them predicts the gold next token there is a sample: label 1 if RAG
    is the one (benefit outweighs detriment), 0 if the pure LLM is. Each scorer gives a number
    > 0 when it would keep the RAG token: Tok-RAG's cos(w_RAG, w_IR) − cos(w_RAG, w_LLM) per
    option set in ``tokrag_configs`` (default :data:`DEFAULT_SCORER_CONFIGS`), the top-1 log-prob
    margin and the entropy margin. Records carry the item's ``source``.
    """
    from tokrag_integrations.policies import get_policy
    from tokrag_integrations.policies.tokrag import TokRAG

    require_bool(progress, "progress")
    configs = dict(DEFAULT_SCORER_CONFIGS if tokrag_configs is None else tokrag_configs)
    scorers = {name: get_policy(**{"name": "tokrag", **opts}) for name, opts in configs.items()}
    for sc in scorers.values():
        sc.prepare(lm)
    walker = TokRAG()
    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    store = RecordStore(records_path)
    conds = noise_conditions(ratios, k, seed) + cf_conditions(cf_ratios, cf_k, seed)
    units = [(it, c, m) for it in items for c, m in conds if it.counterfactuals or c[:3] != "cf="]
    done = sum(1 for it, c, _ in units if (it.id, c, "token") in store)
    bar = progress_bar(len(units), done, "token level", progress)
    try:
        for it, cond, mixer in units:
            if (it.id, cond, "token") in store:
                continue
            mix = mixer(it)
            ids = gold_target(lm.tokenizer, it, target, max_target_tokens)
            samples = (
                _token_samples(lm, builder, walker, scorers, it.question, mix.passages, ids)
                if mix.passages and ids
                else []
            )
            store.add(
                {
                    "task": "token",
                    "item": it.id,
                    "condition": cond,
                    "policy": "token",
                    "source": it.source,
                    "samples": samples,
                    "n_target_tokens": len(ids),
                    "target": target_kind(it, target),
                    "passages": mix.counts,
                }
            )
            bar.update(1)
    finally:
        bar.close()
    ids_ = {it.id for it in items}
    return summarize_token_level([r for r in store.values() if r["item"] in ids_])


def _safe_score(scorer: Any, pure: Any, rag: Any, lens: Any) -> float:
    try:
        return float(scorer.score(pure, rag, lens))
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


def _scorer_figures(
    samples: list[tuple[str, dict[str, Any]]], name: str, seed: int
) -> dict[str, Any]:
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
    samples = [
        (f"{r.get('source', '')}/{r['item']}", smp) for r in records for smp in r.get("samples", [])
    ]
    labels = [smp["label"] for _, smp in samples]
    return {
        "n_samples": len(samples),
        "n_benefit": sum(labels),
        "n_label1": sum(labels),
        "n_label0": len(labels) - sum(labels),
        "n_records": len(records),
        "scorers": {
            n: _scorer_figures(samples, n, seed)
            for n in dict.fromkeys(name for _, smp in samples for name in smp["scores"])
        },
    }


def summarize_token_level(
    records: Iterable[dict[str, Any]], seed: int = BOOTSTRAP_SEED
) -> dict[str, Any]:
    """AUC (95 % bootstrap interval, items resampled) and F1 (decision: score >= 0 keeps RAG)
    per scorer, with the label counts (n label 1 / n label 0): pooled over all records, and
    per ``source`` under ``"sources"``."""
    records = list(records)
    out = _token_figures(records, seed)
    by_source: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_source.setdefault(str(r.get("source") or "items"), []).append(r)
    out["sources"] = {src: _token_figures(rs, seed) for src, rs in sorted(by_source.items())}
    out["bootstrap"] = bootstrap_settings(seed)
    return out
