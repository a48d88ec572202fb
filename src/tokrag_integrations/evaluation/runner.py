"""Runners: noise sweep, misleading passages and token-level classification.

Each runner appends one JSON line per (item id, condition, policy) to ``records_path`` as
soon as it is known and skips the keys already in the file, so a run that was interrupted
(Ctrl-C, a killed job) continues where it stopped when started again with the same
arguments.

What is shared between policies: the passage mix of an (item, condition) (seeded, identical
for every policy); the prompt prefill (inside :func:`..decoding.shared_prefill` every policy
that decodes the same pure / RAG context of the same item batch gets a copy of one prefilled
KV cache; the per-passage contexts of ``rag_token`` / ``rag_sequence`` are prefilled
separately); and the ``llm`` answer, which ignores passages and is decoded once per item and
reused for every condition. Because of that sharing, ``time_s`` in the records is not a cost
measurement; :mod:`.cost` measures cost in isolation.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..prompts import PromptBuilder
from .data import DEFAULT_RATIOS, DEFAULT_SEED, EvalItem, Mix, mix_counterfactuals, mix_passages
from .metrics import auc, cover_em, f1_score, macro_f1

DEFAULT_POLICIES = ("llm", "rag", "tokrag", "cad", "adacad", "logprob", "entropy", "rag_token")
DEFAULT_CF_RATIOS = (0.0, 0.5, 1.0)
#: Condition name of policies that ignore passages: decoded once per item.
NO_PASSAGES = "none"

#: Tok-RAG options measured at token level (min_fusion_layer 10 of 32 in the authors' code
#: scales to 9 of SmolLM2's 30 layers).
TOKRAG_CONFIGS: dict[str, dict[str, Any]] = {
    "tokrag (default: top_k=3, lens_norm=False)": {},
    "paper as written (top_k=None, lens_norm=True)": {"top_k": None, "lens_norm": True},
    "pr_norm=softmax": {"pr_norm": "softmax"},
    "top_k=None": {"top_k": None},
    "lens_norm=True": {"lens_norm": True},
    "min_fusion_layer=9": {"min_fusion_layer": 9},
    "variant=reference": {"variant": "reference"},
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
    store = RecordStore(records_path)
    decode = decode or _default_decode
    policy_options = policy_options or {}
    from ..decoding import shared_prefill
    from ..policies import get_policy

    pols = {p: get_policy(p, **policy_options.get(p, {})) for p in policies}
    # Probing policies first, so the prefill they leave behind serves every other policy.
    order = sorted(policies, key=lambda p: not pols[p].probe_roles)
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
            policy=policy,
            max_new_tokens=max_new_tokens,
            stop=list(stop),
            **policy_options.get(policy, {}),
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
                "time_s": elapsed / len(batch),
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
    return summarize_accuracy(store.values(), items, policies, [c for c, _ in conditions])


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
    return summarize_accuracy(store.values(), items, policies, [c for c, _ in conditions])


def summarize_accuracy(
    records: Iterable[dict[str, Any]],
    items: Sequence[EvalItem],
    policies: Sequence[str],
    conditions: Sequence[str],
) -> dict[str, Any]:
    """Accuracy / counterfactual-repeat rate / time per policy and condition (percent).

    ``llm`` records (condition ``none``) count for every condition. Only the given items
    enter the figures, so a records file shared by larger runs does not leak in.
    """
    ids = {it.id for it in items}
    by: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["item"] in ids:
            by.setdefault((r["policy"], r["condition"]), []).append(r)

    def pick(policy: str, cond: str) -> list[dict[str, Any]]:
        return by.get((policy, cond)) or by.get((policy, NO_PASSAGES)) or []

    acc: dict[str, dict[str, float]] = {}
    rep: dict[str, dict[str, float]] = {}
    n: dict[str, dict[str, int]] = {}
    secs: dict[str, float] = {}
    for p in policies:
        acc[p], rep[p], n[p] = {}, {}, {}
        times: list[float] = []
        for c in conditions:
            rs = pick(p, c)
            n[p][c] = len(rs)
            acc[p][c] = 100 * sum(bool(r["correct"]) for r in rs) / len(rs) if rs else math.nan
            cf = [r for r in rs if r.get("cf_repeat") is not None]
            rep[p][c] = 100 * sum(bool(r["cf_repeat"]) for r in cf) / len(cf) if cf else math.nan
            times += [r["time_s"] for r in rs]
        secs[p] = sum(times) / len(times) if times else math.nan
    passages: dict[str, dict[str, float]] = {}
    short: dict[str, int] = {}
    for c in conditions:
        rs = [r for (p, cc), v in by.items() if cc == c for r in v]
        first = {r["item"]: r for r in rs}
        short[c] = sum(1 for r in first.values() if r.get("short"))
        if first:
            passages[c] = {
                kind: round(sum(r["passages"].get(kind, 0) for r in first.values()) / len(first), 2)
                for kind in ("pos", "neg", "cf")
            }
    return {
        "policies": list(policies),
        "conditions": list(conditions),
        "n_items": len(ids),
        "accuracy": acc,
        "cf_repeat": rep,
        "n": n,
        "mean_time_s": secs,
        "mean_passages": passages,
        "items_short": short,
    }


# --------------------------------------------------------------------------- token level
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def evidence_sentence(item: EvalItem) -> str:
    """The first sentence of a positive passage that contains a gold answer (case-insensitive),
    else the first sentence of the first positive, else the first answer."""
    answers = [a.lower() for a in item.answers if a.strip()]
    sentences = [s.strip() for p in item.positives for s in _SENTENCE.split(p) if s.strip()]
    for s in sentences:
        if any(a in s.lower() for a in answers):
            return s
    if sentences:
        return sentences[0]
    return item.answers[0] if item.answers else ""


def gold_target(tokenizer: Any, item: EvalItem, target: str = "evidence", max_tokens: int = 32) -> list[int]:
    """Token ids of the gold continuation fed after the question.

    ``"answer"``: the first gold answer (capitalised, as a reply would open); ``"evidence"``:
    the answer-bearing sentence of a positive passage (the paper traverses gold sentences),
    cut to ``max_tokens``.
    """
    if target == "answer":
        text = item.answers[0].strip() if item.answers else ""
    elif target == "evidence":
        text = evidence_sentence(item)
    else:
        raise ValueError(f"target must be 'answer' or 'evidence', got {target!r}")
    text = text[:1].upper() + text[1:]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])[:max_tokens] if text else []


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
    answer-bearing evidence sentence by default, or the bare answer) is fed token by token
    after the question (teacher forcing) to both the pure and the RAG context. Where exactly one of
    them predicts the gold next token there is a sample: label 1 if RAG is the one (benefit
    outweighs detriment), 0 if the pure LLM is. Each scorer gives a number that is > 0 when
    it would keep the RAG token: Tok-RAG's cos(w_RAG, w_IR) − cos(w_RAG, w_LLM) for each
    option set in ``tokrag_configs``, the top-1 log-prob margin and the entropy margin.
    """
    from ..decoding import teacher_force
    from ..policies.selection import entropy_margin, logprob_margin
    from ..policies.tokrag import TokRAG

    target_kind = target
    configs = dict(TOKRAG_CONFIGS if tokrag_configs is None else tokrag_configs)
    scorers = {name: TokRAG(**opts) for name, opts in configs.items()}
    for s in scorers.values():
        s.prepare(lm)
    walker = TokRAG()
    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    store = RecordStore(records_path)
    conds: list[tuple[str, Callable[[EvalItem], Mix]]] = [
        (f"{r:g}", (lambda it, r=r: mix_passages(it, r, k=k, seed=seed))) for r in ratios
    ]
    conds += [(f"cf={r:g}", (lambda it, r=r: mix_counterfactuals(it, r, k=cf_k, seed=seed))) for r in cf_ratios]
    units = [(it, c, m) for it in items for c, m in conds if not c.startswith("cf=") or it.counterfactuals]
    bar = _progress(len(units), sum(1 for it, c, _ in units if (it.id, c, "token") in store), "token level", progress)
    try:
        for it, cond, mixer in units:
            if (it.id, cond, "token") in store:
                continue
            mix = mixer(it)
            rec: dict[str, Any] = {"task": "token", "item": it.id, "condition": cond, "policy": "token", "samples": []}
            target = gold_target(lm.tokenizer, it, target_kind, max_target_tokens)
            if mix.passages and target:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = builder.build(it.question, mix.passages, max_new_tokens=len(target) + 1)
                if plan.has_passages:
                    with lm.lock:
                        for _, i, views in teacher_force(lm, [plan], walker, [target]):
                            pure, rag = views["pure"], views["rag"]
                            a = int(pure.logits.argmax().item())
                            b = int(rag.logits.argmax().item())
                            gold = target[i]
                            if (a == gold) == (b == gold):
                                continue
                            scores = {name: _safe_score(s, pure, rag) for name, s in scorers.items()}
                            scores["logprob"] = logprob_margin(pure.probs, rag.probs)
                            scores["entropy"] = entropy_margin(pure.probs, rag.probs)
                            rec["samples"].append({"pos": i, "label": int(b == gold), "scores": scores})
            rec["n_target_tokens"] = len(target)
            rec["target"] = target_kind
            store.add(rec)
            bar.update(1)
    finally:
        bar.close()
    ids = {it.id for it in items}
    return summarize_token_level([r for r in store.values() if r["item"] in ids])


def _safe_score(scorer: Any, pure: Any, rag: Any) -> float:
    try:
        return float(scorer.score(pure, rag))
    except (ValueError, RuntimeError):
        return math.nan


def summarize_token_level(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """AUC and F1 (decision: score >= 0 keeps RAG) per scorer over all samples."""
    records = list(records)
    samples = [s for r in records for s in r.get("samples", [])]
    labels = [s["label"] for s in samples]
    names: list[str] = []
    for s in samples:
        for n in s["scores"]:
            if n not in names:
                names.append(n)
    out: dict[str, Any] = {
        "n_samples": len(samples),
        "n_benefit": sum(labels),
        "n_records": len(records),
        "scorers": {},
    }
    for n in names:
        pairs = [(s["scores"].get(n, math.nan), s["label"]) for s in samples]
        pairs = [(x, y) for x, y in pairs if not math.isnan(x)]
        xs = [x for x, _ in pairs]
        ys = [y for _, y in pairs]
        preds = [int(x >= 0) for x in xs]
        out["scorers"][n] = {
            "auc": 100 * auc(xs, ys) if xs else math.nan,
            "f1": 100 * f1_score(preds, ys) if xs else math.nan,
            "macro_f1": 100 * macro_f1(preds, ys) if xs else math.nan,
            "n": len(xs),
        }
    return out
