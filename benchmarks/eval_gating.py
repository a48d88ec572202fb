"""Evidence for retrieval gating (issue 6) on the dev sets in ../shared/data.

PopQA (no passages), stratified by popularity quintile: per query, one greedy pure draft
through ``ConfidenceGate`` gives the answer and the five confidence metrics (from the
decoder's own distributions); GECE (``self`` and/or ``reference`` mode) on a stratified
subset; CtrlA optionally (``--ctrla``). Reported: AUROC (with a 95 % bootstrap interval) of
each score for predicting that the pure model is wrong (cover-EM), the retrieval rate per
popularity quintile at the calibrated percentile threshold, and a plot.

SQuAD (and optionally RGB / ConflictQA) with the items' own passages: accuracy and wall time
of never / always retrieve and of the ConfidenceGate; Confident-RAG (``--parts crag``).

    nice -n 10 python benchmarks/eval_gating.py --popqa-limit 100 --gece-limit 30 \
        --qa-limit 20 --max-new-tokens 12 --out benchmarks/results/gating
"""

from __future__ import annotations

import argparse
import json
import math
import re
import string
import time
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


def popqa(lm, args, out: dict) -> None:
    """One greedy pure draft per query through :class:`ConfidenceGate` (its details carry
    all five metrics); GECE on a stratified subset; CtrlA optionally (a second decode)."""
    from tokrag_integrations.gating import ConfidenceGate, CtrlAGate, GECEGate
    from tokrag_integrations.gating.metrics import METRICS

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
        ctrla = CtrlAGate(lm, max_new_tokens=args.max_new_tokens)
        t0 = time.perf_counter()
        ctrla.fit_directions()
        out["ctrla_fit_s"] = time.perf_counter() - t0
        toks = []
        for r in rows:
            rr, pol = ctrla.monitor(r["question"])
            r["ctrla_pred"] = rr.text
            toks.append(pol.tokens)
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
        refs = [items[i]["answers"] for i in gsub] if mode == "reference" else None
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
    if "gece_self" in risks and "gece_reference" in risks and len(gsub) > 2:
        a = np.argsort(np.argsort(risks["gece_self"]))
        b = np.argsort(np.argsort(risks["gece_reference"]))
        res["gece_self_vs_reference_spearman"] = float(np.corrcoef(a, b)[0, 1])
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


def passages_of(it: dict, k: int = 3) -> list[str]:
    ps = it["positives"][:1] + it["negatives"][:1] + it["counterfactuals"][:1]
    ps += it["negatives"][1:] + it["positives"][1:]
    return ps[:k]


def qa(lm, args, out: dict) -> None:
    """Never / always retrieve vs the ConfidenceGate (the gate's pure draft doubles as the
    never-retrieve answer; the RAG answer uses the item's own passages, so "always" time is
    decoding only, no retriever). The gate's threshold is the calibrated percentile of the
    set's own draft confidences (in-sample; no gold answers used)."""
    from tokrag_integrations import generate
    from tokrag_integrations.gating import ConfidenceGate

    table = {}
    for name in args.qa_sets.split(","):
        items = load(name, args.qa_limit)
        gate = ConfidenceGate(lm, args.qa_metric, max_new_tokens=args.max_new_tokens)
        recs = []
        for it in items:
            t = time.perf_counter()
            conf, det = gate.score(it["question"])
            t_pure = time.perf_counter() - t
            t = time.perf_counter()
            rr = generate(
                lm,
                it["question"],
                passages_of(it),
                policy="rag",
                max_new_tokens=args.max_new_tokens,
                stop=["\n"],
            )
            t_rag = time.perf_counter() - t
            recs.append(
                {
                    "id": it["id"],
                    "conf": conf,
                    "ok_pure": cover_em(det["draft"], it["answers"]),
                    "ok_rag": cover_em(rr.text, it["answers"]),
                    "t_pure": t_pure,
                    "t_rag": t_rag,
                    "pure": det["draft"],
                    "rag": rr.text,
                }
            )
        acc = {
            "never": float(np.mean([r["ok_pure"] for r in recs])),
            "always": float(np.mean([r["ok_rag"] for r in recs])),
        }
        secs = {
            "never": sum(r["t_pure"] for r in recs),
            "always": sum(r["t_rag"] for r in recs),
        }
        rate = {}
        confs = [r["conf"] for r in recs]
        for pct in (50.0, 80.0):
            key = f"confidence:{args.qa_metric}@p{int(pct)}"
            gate.set_threshold_from_scores(confs, pct)
            dec = [gate.retrieves(c) for c in confs]
            acc[key] = float(
                np.mean(
                    [r["ok_rag"] if d else r["ok_pure"] for r, d in zip(recs, dec, strict=True)]
                )
            )
            secs[key] = sum(
                r["t_pure"] + (r["t_rag"] if d else 0.0) for r, d in zip(recs, dec, strict=True)
            )
            rate[key] = float(np.mean(dec))
        table[name] = {
            "n": len(items),
            "accuracy": acc,
            "seconds": secs,
            "retrieval_rate": rate,
            "rows": recs,
        }
    out["qa"] = table


def crag(lm, args, out: dict) -> None:
    from tokrag_integrations.gating import confident_rag
    from tokrag_integrations.retrieval import BM25Retriever, Chunk, DenseRetriever

    items = load("squad", args.crag_limit)
    pool = load("squad", 300)
    texts = sorted({p for it in pool for p in it["positives"] + it["negatives"]})
    chunks = [Chunk(t, "squad_dev", i) for i, t in enumerate(texts)]
    rets = {"dense": DenseRetriever(chunks), "bm25": BM25Retriever(chunks)}
    acc = {"dense": [], "bm25": [], "confident_rag:self_certainty": [], "confident_rag:dp": []}
    secs = dict.fromkeys(acc, 0.0)
    for it in items:
        t = time.perf_counter()
        res = confident_rag(
            lm,
            it["question"],
            rets,
            metric="self_certainty",
            top_k=2,
            max_new_tokens=args.max_new_tokens,
        )
        el = time.perf_counter() - t
        by = {c["retriever"]: c for c in res.candidates}
        for n in rets:
            acc[n].append(cover_em(by[n]["text"], it["answers"]))
            secs[n] += by[n]["seconds"]
        acc["confident_rag:self_certainty"].append(cover_em(res.text, it["answers"]))
        secs["confident_rag:self_certainty"] += el
        best_dp = max(res.candidates, key=lambda c: c["metrics"]["confidence"]["dp"])
        acc["confident_rag:dp"].append(cover_em(best_dp["text"], it["answers"]))
        secs["confident_rag:dp"] += el
    out["confident_rag_squad"] = {
        "n": len(items),
        "corpus_chunks": len(chunks),
        "accuracy": {k: float(np.mean(v)) for k, v in acc.items()},
        "seconds": secs,
    }


def _brief(out: dict) -> dict:
    o = {k: v for k, v in out.items() if k != "popqa_rows"}
    if "qa" in o:
        o["qa"] = {n: {k: v for k, v in t.items() if k != "rows"} for n, t in o["qa"].items()}
    return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--popqa-limit", type=int, default=100, help="PopQA items (1/5 per quintile)")
    ap.add_argument("--gece-limit", type=int, default=30, help="GECE subset (0: skip GECE)")
    ap.add_argument("--gece-modes", default="self", help="comma list of self,reference")
    ap.add_argument("--gece-samples", type=int, default=2)
    ap.add_argument("--ctrla", action="store_true", help="also run CtrlA (second decode)")
    ap.add_argument("--percentile", type=float, default=80.0, help="%% answered w/o retrieval")
    ap.add_argument("--qa-sets", default="squad", help="comma list: squad,rgb_en_fact,...")
    ap.add_argument("--qa-limit", type=int, default=20)
    ap.add_argument("--qa-metric", default="self_certainty")
    ap.add_argument("--crag-limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--parts", default="popqa,qa")
    ap.add_argument("--out", default="benchmarks/results/gating")
    args = ap.parse_args()
    from tokrag_integrations import load_model

    Path(args.out).mkdir(parents=True, exist_ok=True)
    lm = load_model("default", device="cpu")
    out: dict = {"args": vars(args), "model": lm.name}
    for part in args.parts.split(","):
        t = time.perf_counter()
        {"popqa": popqa, "qa": qa, "crag": crag}[part](lm, args, out)
        out[f"{part}_wall_s"] = time.perf_counter() - t
        (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1, default=str))
        print(
            json.dumps(_brief(out), indent=1, default=str),
            flush=True,
        )


if __name__ == "__main__":
    main()
