"""Evidence for retrieval gating (issue 6) on the dev sets in ../shared/data.

PopQA (no passages), stratified by popularity quintile: per query, one greedy pure draft
through ``ConfidenceGate`` gives the answer and the five confidence metrics (from the
decoder's own distributions); GECE (``self`` and/or ``gold`` mode) on a stratified
subset; CtrlA optionally (``--ctrla``). Reported: AUROC (with a 95 % bootstrap interval) of
each score for predicting that the pure model is wrong (cover-EM), the retrieval rate per
popularity quintile at the calibrated percentile threshold, and a plot.

``--parts qa``: SQuAD / RGB / ConflictQA with the items' own passages: accuracy and wall time
of never / always retrieve and of each gate in ``--qa-gates`` (ConfidenceGate, CtrlA, GECE
self mode) at the ``--qa-percentiles`` thresholds. Correctness: cover-EM, except yes/no items
(ConflictQA), where the first "yes"/"no" word of the answer must equal the gold label.

``--parts crag``: Confident-RAG on SQuAD (dense MiniLM vs BM25 vs the answer picked by
Self-Certainty or DP).

    nice -n 10 python benchmarks/eval_gating.py --parts qa \
        --qa-sets rgb_en_fact,conflictqa_strategyqa --qa-limit 50 \
        --qa-gates confidence,ctrla,gece --shuffle-passages --max-new-tokens 32 \
        --out benchmarks/results/gating/rgb_cqa50
"""

from __future__ import annotations

import argparse
import json
import math
import re
import string
import time
import zlib
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def norm(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def cover_em(pred: str, answers: list[str]) -> bool:
    """A normalised gold answer occurs in the normalised prediction as whole words."""
    p = f" {norm(pred)} "
    return any(norm(a) and f" {norm(a)} " in p for a in answers)


YESNO = frozenset({"yes", "no"})


def is_yesno(answers: list[str]) -> bool:
    """A yes/no item (ConflictQA / StrategyQA): every gold answer is "yes" or "no"."""
    return bool(answers) and {norm(a) for a in answers} <= YESNO


def yesno_of(pred: str) -> str | None:
    """The first whole-word "yes" or "no" of the normalised prediction (None if neither)."""
    for w in norm(pred).split():
        if w in YESNO:
            return w
    return None


def correct(pred: str, answers: list[str]) -> bool:
    """Yes/no items: the prediction's first yes/no word equals the gold label (no yes/no
    word = wrong). Other items: :func:`cover_em`."""
    if is_yesno(answers):
        return yesno_of(pred) == norm(answers[0])
    return cover_em(pred, answers)


def auroc(scores: list[float], labels: list[int]) -> float:
    """P(score of a positive > score of a negative), ties 1/2 (Mann-Whitney)."""
    s = np.asarray([x if math.isfinite(x) else (1e300 if x > 0 else -1e300) for x in scores])
    y = np.asarray(labels)
    pos, neg = s[y == 1], s[y == 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (len(pos) * len(neg)))


def load(name: str, limit: int, stratify: bool = False) -> list[dict]:
    rows = [json.loads(line) for line in (DATA / f"{name}_dev.jsonl").open()]
    if stratify:
        per = max(1, limit // 5)
        out = []
        for b in range(5):
            out += [r for r in rows if r["meta"]["pop_bin"] == b][:per]
        return out
    return rows[:limit]


def bootstrap_ci(scores: list[float], labels: list[int], n: int = 1000, seed: int = 0):
    """95 % percentile-bootstrap interval of :func:`auroc` (items resampled)."""
    rng = np.random.default_rng(seed)
    s, y = np.asarray(scores, dtype=float), np.asarray(labels)
    vals = []
    for _ in range(n):
        i = rng.integers(0, len(s), len(s))
        v = auroc(list(s[i]), list(y[i]))
        if math.isfinite(v):
            vals.append(v)
    if not vals:
        return [float("nan"), float("nan")]
    return [float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))]


def _rates(decisions: list[bool], bins: list[int]) -> list[float]:
    out = []
    for b in range(5):
        d = [x for x, bb in zip(decisions, bins, strict=True) if bb == b]
        out.append(float(np.mean(d)) if d else float("nan"))
    return out


def _fitted_ctrla(lm, args) -> tuple:
    """A CtrlAGate with its directions fitted, and the seconds the fit took."""
    from tokrag_integrations.gating import CtrlAGate

    gate = CtrlAGate(lm, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    gate.fit_directions()
    return gate, time.perf_counter() - t0


def popqa(lm, args, out: dict) -> None:
    """One greedy pure draft per query through :class:`ConfidenceGate` (its details carry
    all five metrics); GECE on a stratified subset; CtrlA optionally (a second decode)."""
    from tokrag_integrations.gating import ConfidenceGate, GECEGate
    from tokrag_integrations.gating.confidence import METRICS

    items = load("popqa", args.popqa_limit, stratify=True)
    gate = ConfidenceGate(lm, "self_certainty", max_new_tokens=args.max_new_tokens)
    rows = []
    for it in items:
        t = time.perf_counter()
        s, det = gate.score(it["question"])
        rows.append(
            {
                "id": it["id"],
                "question": it["question"],
                "answers": it["answers"],
                "pop": it["popularity"],
                "bin": it["meta"]["pop_bin"],
                "pred": det["draft"],
                "wrong": int(not cover_em(det["draft"], it["answers"])),
                "conf": det["metrics"]["confidence"],
                "raw": det["metrics"]["raw"],
                "n_tokens": det["metrics"]["n_tokens"],
                "s": time.perf_counter() - t,
            }
        )
    labels = [r["wrong"] for r in rows]
    bins = [r["bin"] for r in rows]
    res: dict = {
        "n": len(rows),
        "n_per_quintile": [bins.count(b) for b in range(5)],
        "pure_accuracy": 1 - float(np.mean(labels)),
        "mean_draft_s": float(np.mean([r["s"] for r in rows])),
    }
    risks: dict[str, list[float]] = {}  # higher = more likely wrong
    for k in METRICS:
        risks[f"confidence:{k}"] = [-r["conf"][k] for r in rows]
    risks["popularity_oracle"] = [-math.log(r["pop"] + 1) for r in rows]
    rates: dict[str, list[float]] = {}
    thresholds: dict[str, float] = {}
    # ConfidenceGate per metric: threshold = calibrated percentile of the sample's own
    # confidences (in-sample; no gold answers are used to set it).
    for k in METRICS:
        g = ConfidenceGate(lm, k, max_new_tokens=args.max_new_tokens)
        sc = [r["conf"][k] for r in rows]
        thresholds[f"confidence:{k}"] = g.set_threshold_from_scores(sc, args.percentile)
        rates[f"confidence:{k}"] = _rates([g.retrieves(x) for x in sc], bins)
    if args.ctrla:
        ctrla, out["ctrla_fit_s"] = _fitted_ctrla(lm, args)
        toks = []
        for r in rows:
            t = time.perf_counter()
            rr, pol = ctrla.monitor(r["question"])
            r["ctrla_s"] = time.perf_counter() - t
            r["ctrla_pred"] = rr.text
            toks.append(pol.tokens)
        res["ctrla_mean_monitor_s"] = float(np.mean([r["ctrla_s"] for r in rows]))
        ms = [tk["m"] for tt in toks for tk in tt if tk["content"]] or [0.0, 1.0]
        ctrla.mean, ctrla.std = float(np.mean(ms)), float(np.std(ms) or 1.0)
        for r, tt in zip(rows, toks, strict=True):
            for tk in tt:
                tk["z"] = (tk["m"] - ctrla.mean) / ctrla.std
            r["ctrla"] = ctrla.score_tokens(r["ctrla_pred"], tt)
        sc = [r["ctrla"] for r in rows]
        risks["ctrla"] = [-x for x in sc]
        thresholds["ctrla"] = ctrla.set_threshold_from_scores(sc, args.percentile)
        rates["ctrla"] = _rates([ctrla.retrieves(x) for x in sc], bins)
    # GECE on the first gece_limit items of the stratified order interleaved by quintile.
    per = len(items) // 5 or 1
    gsub = sorted(range(len(items)), key=lambda i: (i % per, i))[: args.gece_limit]
    for mode in args.gece_modes.split(",") if args.gece_limit else []:
        g = GECEGate(lm, mode, n_samples=args.gece_samples, max_new_tokens=args.max_new_tokens)
        q = [items[i]["question"] for i in gsub]
        refs = [items[i]["answers"] for i in gsub] if mode == "gold" else None
        t = time.perf_counter()
        scores = g.calibrate(q, percentile=args.percentile, references=refs)
        out[f"gece_{mode}_s_per_query"] = (time.perf_counter() - t) / max(1, len(q))
        thresholds[f"gece_{mode}"] = g.threshold
        for i, s in zip(gsub, scores, strict=True):
            rows[i][f"gece_{mode}"] = s
        risks[f"gece_{mode}"] = [rows[i][f"gece_{mode}"] for i in gsub]
        rates[f"gece_{mode}"] = _rates([g.retrieves(s) for s in scores], [bins[i] for i in gsub])
    au, ci, n_of = {}, {}, {}
    for name, rk in risks.items():
        lab = [labels[i] for i in gsub] if name.startswith("gece_") else labels
        au[name] = auroc(rk, lab)
        ci[name] = bootstrap_ci(rk, lab)
        n_of[name] = len(lab)
    res["auroc_wrong"] = au
    res["auroc_ci95"] = ci
    res["auroc_n"] = n_of
    res["gece_n"] = len(gsub) if args.gece_limit else 0
    if args.gece_limit:
        res["gece_subset_pure_accuracy"] = 1 - float(np.mean([labels[i] for i in gsub]))
        # the confidence metrics on the same subset, for a like-for-like comparison
        res["auroc_on_gece_subset"] = {
            k: auroc([risks[k][i] for i in gsub], [labels[i] for i in gsub])
            for k in risks
            if not k.startswith("gece_")
        }
    if "gece_self" in risks and "gece_gold" in risks and len(gsub) > 2:
        a = np.argsort(np.argsort(risks["gece_self"]))
        b = np.argsort(np.argsort(risks["gece_gold"]))
        res["gece_self_vs_gold_spearman"] = float(np.corrcoef(a, b)[0, 1])
    res["percentile"] = args.percentile
    res["thresholds"] = thresholds
    res["retrieval_rate_by_quintile"] = rates
    res["wrong_rate_by_quintile"] = _rates([bool(x) for x in labels], bins)
    out["popqa"] = res
    out["popqa_rows"] = rows
    _plot(res, Path(args.out))


def _plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    names = list(res["auroc_wrong"])
    vals = [res["auroc_wrong"][n] for n in names]
    ci = res.get("auroc_ci95", {})
    err = np.array(
        [
            [v - ci.get(n, [v, v])[0] for n, v in zip(names, vals, strict=True)],
            [ci.get(n, [v, v])[1] - v for n, v in zip(names, vals, strict=True)],
        ]
    )
    labels = [f"{n} (n={res.get('auroc_n', {}).get(n, '?')})" for n in names]
    ax[0].barh(labels, vals, xerr=err, capsize=3)
    ax[0].axvline(0.5, color="k", ls="--")
    ax[0].set_xlim(0, 1)
    ax[0].set_xlabel("AUROC, 95% bootstrap CI (score predicts pure model wrong)")
    for name, r in res["retrieval_rate_by_quintile"].items():
        ax[1].plot(range(5), r, marker="o", label=name)
    ax[1].plot(range(5), res["wrong_rate_by_quintile"], "k--", label="pure model wrong")
    ax[1].set_xlabel("popularity quintile (0 = long tail)")
    ax[1].set_ylabel(f"retrieval rate (threshold: p{res.get('percentile', 80):g})")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "popqa_gating.png", dpi=110)


def passages_of(it: dict, k: int = 3, shuffle: bool = False) -> list[str]:
    """The item's own passages: its first positive, first negative, first counterfactual,
    then further negatives / positives, ``k`` at most (SQuAD: positive + 2 hard negatives;
    RGB: positive + negative + counterfactual; ConflictQA: positive + counterfactual).
    ``shuffle``: put them in an order drawn from the item's id (so the positive is not
    always first: a small model's position bias would otherwise favour it)."""
    ps = it["positives"][:1] + it["negatives"][:1] + it["counterfactuals"][:1]
    ps = (ps + it["negatives"][1:] + it["positives"][1:])[:k]
    if shuffle:
        rng = np.random.default_rng(zlib.crc32(str(it["id"]).encode()))
        ps = [ps[i] for i in rng.permutation(len(ps))]
    return ps


def question_of(it: dict, suffix: str) -> str:
    """The query text; yes/no items get ``suffix`` (e.g. " Answer yes or no.") appended."""
    return it["question"] + (suffix if suffix and is_yesno(it["answers"]) else "")


#: The gates of the qa part: per-item score field, pure-answer field, time field (a number
#: = a table key holding the per-query mean), and the side of the threshold that retrieves.
QA_GATES = {
    "confidence": ("conf", "pure", "t_pure", "below"),
    "ctrla": ("ctrla", "ctrla_text", "t_ctrla", "below"),
    "gece": ("gece_self", "gece_pred", "gece_self_s_per_query", "above"),
}


def summarise_qa(t: dict, metric: str, percentiles: list[float]) -> dict:
    """Accuracy / seconds / retrieval rate / thresholds / AUROC of a qa table from its
    per-item ``rows`` (no model: ``--rescore`` reruns this on a saved results.json).

    A gated pipeline answers with the gate's own pure draft unless the gate retrieves, then
    with the RAG answer; its time = the gate's cost (its draft included) + the RAG decode
    when it retrieves. Thresholds: percentiles of the set's own scores (in-sample)."""
    from tokrag_integrations.gating.confidence import METRICS
    from tokrag_integrations.gating.gate_base import Gate

    recs = t["rows"]
    acc = {
        "never": float(np.mean([r["ok_pure"] for r in recs])),
        "always": float(np.mean([r["ok_rag"] for r in recs])),
        "oracle (retrieve iff pure wrong)": float(
            np.mean([r["ok_pure"] or r["ok_rag"] for r in recs])
        ),
    }
    secs = {
        "never": sum(r["t_pure"] for r in recs),
        "always": sum(r["t_rag"] for r in recs),
        "oracle (retrieve iff pure wrong)": sum(
            r["t_pure"] + (0.0 if r["ok_pure"] else r["t_rag"]) for r in recs
        ),
    }
    rate = {
        "never": 0.0,
        "always": 1.0,
        "oracle (retrieve iff pure wrong)": float(np.mean([not r["ok_pure"] for r in recs])),
    }
    wrong = [int(not r["ok_pure"]) for r in recs]
    au = {f"confidence:{k}": auroc([-r["confidences"][k] for r in recs], wrong) for k in METRICS}
    thr: dict[str, float] = {}
    for gname, (sf, tf, timef, side) in QA_GATES.items():
        if sf not in recs[0]:
            continue
        name = {"confidence": f"confidence:{metric}", "gece": "gece_self"}.get(gname, gname)
        scores = [float(r[sf]) for r in recs]
        ok = [correct(r[tf], r["answers"]) for r in recs]
        cost = [t[timef]] * len(recs) if timef in t else [r[timef] for r in recs]
        au[name] = auroc(scores if side == "above" else [-x for x in scores], wrong)
        gate = Gate()
        gate.retrieve_when = side
        for pct in percentiles:
            key = f"{name}@p{pct:g}"
            thr[key] = gate.set_threshold_from_scores(scores, pct)
            dec = [gate.retrieves(x) for x in scores]
            acc[key] = float(
                np.mean([r["ok_rag"] if d else o for r, d, o in zip(recs, dec, ok, strict=True)])
            )
            secs[key] = sum(cost) + sum(r["t_rag"] for r, d in zip(recs, dec, strict=True) if d)
            rate[key] = float(np.mean(dec))
    return {
        "accuracy": acc,
        "seconds": secs,
        "retrieval_rate": rate,
        "thresholds": thr,
        "auroc_pure_wrong": au,
    }


def qa(lm, args, out: dict) -> None:
    """Never / always retrieve vs each gate on sets with passages (the item's own passages:
    no retriever, so "always" time is decoding only). ConfidenceGate: its pure draft is the
    never-retrieve answer. CtrlA (``--qa-gates ...,ctrla``): its monitored greedy decode is
    the answer when it does not retrieve. GECE (``...,gece``, self mode): its greedy draft is
    the answer, its cost includes the samples and the gradient. Rows: :func:`summarise_qa`."""
    from tokrag_integrations import generate
    from tokrag_integrations.gating import ConfidenceGate, GECEGate

    gates = [g for g in args.qa_gates.split(",") if g]
    pcts = [float(x) for x in args.qa_percentiles.split(",")]
    table = out.setdefault("qa", {})
    for name in args.qa_sets.split(","):
        items = load(name, args.qa_limit)
        gate = ConfidenceGate(lm, args.qa_metric, max_new_tokens=args.max_new_tokens)
        recs = []
        for it in items:
            q = question_of(it, args.yesno_suffix)
            t = time.perf_counter()
            conf, det = gate.score(q)
            t_pure = time.perf_counter() - t
            t = time.perf_counter()
            rr = generate(
                lm,
                q,
                passages_of(it, args.qa_passages, args.shuffle_passages),
                policy="rag",
                max_new_tokens=args.max_new_tokens,
                stop=["\n"],
            )
            t_rag = time.perf_counter() - t
            recs.append(
                {
                    "id": it["id"],
                    "question": q,
                    "answers": it["answers"],
                    "conf": conf,
                    "confidences": det["metrics"]["confidence"],
                    "ok_pure": correct(det["draft"], it["answers"]),
                    "ok_rag": correct(rr.text, it["answers"]),
                    # RGB: the RAG answer repeats a counterfactual passage's wrong answer
                    "misled_rag": bool(it["counterfactual_answers"])
                    and not is_yesno(it["answers"])
                    and cover_em(rr.text, it["counterfactual_answers"]),
                    "t_pure": t_pure,
                    "t_rag": t_rag,
                    "pure": det["draft"],
                    "rag": rr.text,
                }
            )
        if "confidence" not in gates:
            for r in recs:
                del r["conf"]
        extra: dict = {}
        if "ctrla" in gates:
            ctrla, extra["ctrla_fit_s"] = _fitted_ctrla(lm, args)
            runs = []
            for r in recs:
                t = time.perf_counter()
                runs.append(ctrla.monitor(r["question"]))
                r["t_ctrla"] = time.perf_counter() - t
            # z-score statistics: the set's own content tokens (in-sample calibration)
            ms = [tk["m"] for _, pol in runs for tk in pol.tokens if tk["content"]] or [0.0, 1.0]
            ctrla.mean, ctrla.std = float(np.mean(ms)), float(np.std(ms) or 1.0)
            for r, (res, pol) in zip(recs, runs, strict=True):
                for tk in pol.tokens:
                    tk["z"] = (tk["m"] - ctrla.mean) / ctrla.std
                r.update(ctrla=ctrla.score_tokens(res.text, pol.tokens), ctrla_text=res.text)
        if "gece" in gates:
            g = GECEGate(
                lm, "self", n_samples=args.gece_samples, max_new_tokens=args.max_new_tokens
            )
            t0 = time.perf_counter()
            terms = g.fit_mean_gradient([r["question"] for r in recs])
            # per query, E(grad) pass included (the scores reuse the calibration terms)
            extra["gece_self_s_per_query"] = (time.perf_counter() - t0) / len(recs)
            for r, tm in zip(recs, terms, strict=True):
                r.update(gece_self=g.gece(tm)[0], gece_pred=tm["pred"])
        tab = {
            "n": len(items),
            "yesno": all(is_yesno(r["answers"]) for r in recs),
            "rag_repeats_counterfactual_rate": float(np.mean([r["misled_rag"] for r in recs])),
            "pure_rag_crosstab": {
                f"pure_{'ok' if a else 'wrong'}/rag_{'ok' if b else 'wrong'}": sum(
                    (r["ok_pure"], r["ok_rag"]) == (a, b) for r in recs
                )
                for a in (True, False)
                for b in (True, False)
            },
            **extra,
            "rows": recs,
        }
        if tab["yesno"]:
            gold = [norm(r["answers"][0]) for r in recs]
            tab["majority_label_accuracy"] = max(gold.count("yes"), gold.count("no")) / len(gold)
            tab["no_yesno_word_rate"] = {
                "pure": float(np.mean([yesno_of(r["pure"]) is None for r in recs])),
                "rag": float(np.mean([yesno_of(r["rag"]) is None for r in recs])),
            }
        tab.update(summarise_qa(tab, args.qa_metric, pcts))
        table[name] = tab
        save(args, out)


def crag(lm, args, out: dict) -> None:
    """Confident-RAG on SQuAD dev: a corpus of every positive and hard negative of the first
    300 dev items, dense (MiniLM) and BM25 retrievers, one RAG answer per retriever; the
    answer picked by Self-Certainty and, from the same candidates, by DP. Seconds per
    retriever = its retrieval + decode; Confident-RAG = both (sequential)."""
    from tokrag_integrations.gating import confident_rag
    from tokrag_integrations.retrieval import BM25Retriever, Chunk, DenseRetriever

    items = load("squad", args.crag_limit)
    pool = load("squad", 300)
    texts = sorted({p for it in pool for p in it["positives"] + it["negatives"]})
    chunks = [Chunk(t, "squad_dev", i) for i, t in enumerate(texts)]
    t0 = time.perf_counter()
    rets = {"dense": DenseRetriever(chunks), "bm25": BM25Retriever(chunks)}
    index_s = time.perf_counter() - t0
    picks = ("self_certainty", "dp")
    acc: dict[str, list[bool]] = {n: [] for n in rets}
    acc.update({f"confident_rag:{m}": [] for m in picks})
    acc["oracle (either retriever right)"] = []
    hit: dict[str, list[bool]] = {n: [] for n in rets}
    secs = dict.fromkeys(acc, 0.0)
    rows = []
    for it in items:
        t = time.perf_counter()
        res = confident_rag(
            lm,
            it["question"],
            rets,
            metric="self_certainty",
            top_k=args.crag_top_k,
            max_new_tokens=args.max_new_tokens,
        )
        el = time.perf_counter() - t
        by = {c["retriever"]: c for c in res.candidates}
        ok = {n: correct(by[n]["text"], it["answers"]) for n in rets}
        for n in rets:
            acc[n].append(ok[n])
            secs[n] += by[n]["seconds"]
            hit[n].append(bool(set(by[n]["passages"]) & set(it["positives"])))
        chosen = {
            m: max(res.candidates, key=lambda c, m=m: c["metrics"]["confidence"][m])["retriever"]
            for m in picks
        }
        for m in picks:
            acc[f"confident_rag:{m}"].append(ok[chosen[m]])
            secs[f"confident_rag:{m}"] += el
        acc["oracle (either retriever right)"].append(any(ok.values()))
        secs["oracle (either retriever right)"] += el
        rows.append(
            {
                "id": it["id"],
                "question": it["question"],
                "answers": it["answers"],
                "chosen": chosen,
                **{
                    n: {
                        "text": by[n]["text"],
                        "ok": ok[n],
                        "gold_passage_retrieved": hit[n][-1],
                        "confidence": {m: by[n]["metrics"]["confidence"][m] for m in picks},
                        "seconds": by[n]["seconds"],
                    }
                    for n in rets
                },
            }
        )
    out["confident_rag_squad"] = {
        "n": len(items),
        "top_k": args.crag_top_k,
        "corpus_chunks": len(chunks),
        "index_build_s": index_s,
        "accuracy": {k: float(np.mean(v)) for k, v in acc.items()},
        "gold_passage_in_top_k": {n: float(np.mean(v)) for n, v in hit.items()},
        "picked_dense_rate": {
            m: float(np.mean([r["chosen"][m] == "dense" for r in rows])) for m in picks
        },
        "seconds": secs,
        "rows": rows,
    }


def save(args, out: dict) -> None:
    (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1, default=str))


def _brief(out: dict) -> dict:
    o = {k: v for k, v in out.items() if k != "popqa_rows"}
    if "qa" in o:
        o["qa"] = {n: {k: v for k, v in t.items() if k != "rows"} for n, t in o["qa"].items()}
    if "confident_rag_squad" in o:
        o["confident_rag_squad"] = {
            k: v for k, v in o["confident_rag_squad"].items() if k != "rows"
        }
    return o


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--parts", default="popqa,qa", help="comma list of popqa,qa,crag")
    ap.add_argument("--out", default="benchmarks/results/gating", help="results folder")
    ap.add_argument("--max-new-tokens", type=int, default=12, help="answer length, every part")
    ap.add_argument("--percentile", type=float, default=80.0, help="%% answered w/o retrieval")
    g = ap.add_argument_group("popqa")
    g.add_argument("--popqa-limit", type=int, default=100, help="PopQA items (1/5 per quintile)")
    g.add_argument("--gece-limit", type=int, default=30, help="GECE subset (0: skip GECE)")
    g.add_argument("--gece-modes", default="self", help="comma list of self,gold")
    g.add_argument("--gece-samples", type=int, default=2, help="GECE self mode: sampled refs")
    g.add_argument("--ctrla", action="store_true", help="also score CtrlA (second decode)")
    g = ap.add_argument_group("qa (sets with passages)")
    g.add_argument(
        "--qa-sets", default="squad", help="comma list of squad,rgb_en_fact,conflictqa_strategyqa"
    )
    g.add_argument("--qa-limit", type=int, default=20, help="first N items of each set")
    g.add_argument(
        "--qa-gates", default="confidence", help="comma list of confidence,ctrla,gece (self mode)"
    )
    g.add_argument("--qa-metric", default="self_certainty", help="the ConfidenceGate's metric")
    g.add_argument("--qa-percentiles", default="50,80", help="gate thresholds to report")
    g.add_argument("--qa-passages", type=int, default=3, help="passages per RAG answer")
    g.add_argument(
        "--shuffle-passages",
        action="store_true",
        help="order each item's passages by a draw seeded with its id (else positive first)",
    )
    g.add_argument(
        "--yesno-suffix",
        default=" Answer yes or no.",
        help="appended to yes/no questions (ConflictQA); '' for none",
    )
    g.add_argument(
        "--rescore",
        action="store_true",
        help="no model: recompute the qa tables of <out>/results.json from its saved rows",
    )
    g = ap.add_argument_group("crag (Confident-RAG on SQuAD)")
    g.add_argument("--crag-limit", type=int, default=10, help="first N SQuAD dev items")
    g.add_argument("--crag-top-k", type=int, default=2, help="passages per retriever")
    args = ap.parse_args()
    if args.rescore:
        out = json.loads((Path(args.out) / "results.json").read_text())
        pcts = [float(x) for x in args.qa_percentiles.split(",")]
        for t in out.get("qa", {}).values():
            t.update(summarise_qa(t, out["args"]["qa_metric"], pcts))
        out["rescored_with"] = {"qa_percentiles": args.qa_percentiles}
        save(args, out)
        print(json.dumps(_brief(out), indent=1, default=str))
        return
    from tokrag_integrations import load_model

    Path(args.out).mkdir(parents=True, exist_ok=True)
    lm = load_model("default", device="cpu")
    out: dict = {"args": vars(args), "model": lm.name}
    for part in args.parts.split(","):
        t = time.perf_counter()
        {"popqa": popqa, "qa": qa, "crag": crag}[part](lm, args, out)
        out[f"{part}_wall_s"] = time.perf_counter() - t
        save(args, out)
        print(
            json.dumps(_brief(out), indent=1, default=str),
            flush=True,
        )


if __name__ == "__main__":
    main()
