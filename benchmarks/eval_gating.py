"""Evidence for retrieval gating (issue 6) on the dev sets in ../shared/data.

PopQA (no passages): per query, one monitored greedy decode of the pure context gives the
pure answer, the five confidence metrics (from the decoder's own distributions) and CtrlA's
per-token scores; GECE (self and reference modes) adds samples and a gradient. Reported:
AUROC of each score for predicting that the pure model is wrong (cover-EM), retrieval rate
per popularity quintile at each gate's calibrated threshold, and a plot.

SQuAD / RGB / ConflictQA (with passages): accuracy and wall time of never / always retrieve
and of the gated pipelines; Confident-RAG (dense + BM25 over the set's own passages) vs each
single retriever.

    nice -n 10 python benchmarks/eval_gating.py --popqa-limit 40 --gece-limit 20 \
        --qa-limit 10 --max-new-tokens 16 --out benchmarks/results/gating
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


def popqa(lm, args, out: dict) -> None:
    from tokrag_integrations.gating import CtrlAGate, GECEGate
    from tokrag_integrations.gating.metrics import DIRECTION, METRICS, metrics_from_result

    items = load("popqa", args.popqa_limit, stratify=True)
    ctrla = CtrlAGate(lm, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    ctrla.fit_directions()
    out["ctrla_fit_s"] = time.perf_counter() - t0
    rows = []
    for it in items:
        t = time.perf_counter()
        r, pol = ctrla.monitor(it["question"])
        m = metrics_from_result(r, lm.vocab_size, role="pure")
        rows.append(
            {
                "id": it["id"],
                "pop": it["popularity"],
                "bin": it["meta"]["pop_bin"],
                "pred": r.text,
                "wrong": int(not cover_em(r.text, it["answers"])),
                "conf": m.confidence,
                "raw": m.raw,
                "tokens": pol.tokens,
                "s": time.perf_counter() - t,
            }
        )
    # CtrlA token statistics + threshold from the sample itself (in-sample calibration).
    ms = [tk["m"] for r in rows for tk in r["tokens"] if tk["content"]] or [0.0, 1.0]
    ctrla.mean, ctrla.std = float(np.mean(ms)), float(np.std(ms) or 1.0)
    for r in rows:
        for tk in r["tokens"]:
            tk["z"] = (tk["m"] - ctrla.mean) / ctrla.std
        r["ctrla"] = ctrla.score_tokens(r["pred"], r["tokens"])
    # GECE on the first gece_limit items (stratified order interleaved by bin).
    gsub = sorted(range(len(items)), key=lambda i: (i % (len(items) // 5 or 1), i))[
        : args.gece_limit
    ]
    for mode in ("self", "reference"):
        g = GECEGate(lm, mode, n_samples=args.gece_samples, max_new_tokens=args.max_new_tokens)
        q = [items[i]["question"] for i in gsub]
        refs = [items[i]["answers"] for i in gsub] if mode == "reference" else None
        t = time.perf_counter()
        scores = g.calibrate(q, percentile=80, references=refs)
        out[f"gece_{mode}_s_per_query"] = (time.perf_counter() - t) / max(1, len(q))
        for i, s in zip(gsub, scores, strict=True):
            rows[i][f"gece_{mode}"] = s
    labels = [r["wrong"] for r in rows]
    res: dict = {"n": len(rows), "pure_accuracy": 1 - float(np.mean(labels))}
    au = {}
    for k in METRICS:  # risk = -confidence
        au[f"confidence:{k}"] = auroc([-r["conf"][k] for r in rows], labels)
    au["ctrla"] = auroc([-r["ctrla"] for r in rows], labels)
    au["popularity_oracle"] = auroc([-math.log(r["pop"] + 1) for r in rows], labels)
    for mode in ("self", "reference"):
        sub = [r for r in rows if f"gece_{mode}" in r]
        au[f"gece_{mode}"] = auroc([r[f"gece_{mode}"] for r in sub], [r["wrong"] for r in sub])
    res["auroc_wrong"] = au
    res["gece_n"] = len(gsub)
    sub = [r for r in rows if "gece_self" in r]
    if len(sub) > 2:
        res["gece_self_vs_reference_spearman"] = float(
            np.corrcoef(
                np.argsort(np.argsort([r["gece_self"] for r in sub])),
                np.argsort(np.argsort([r["gece_reference"] for r in sub])),
            )[0, 1]
        )
    # Retrieval rate per popularity quintile at the calibrated thresholds.
    rates = {}
    risks = {f"confidence:{k}": [-r["conf"][k] for r in rows] for k in ("self_certainty", "dp")}
    risks["ctrla"] = [-r["ctrla"] for r in rows]
    for name, rk in risks.items():
        thr = np.percentile([x for x in rk if math.isfinite(x)], 50)
        rates[name + " (p50)"] = [
            float(np.mean([rk[i] > thr for i in range(len(rows)) if rows[i]["bin"] == b]))
            for b in range(5)
        ]
    for mode in ("self", "reference"):
        idx = [i for i, r in enumerate(rows) if f"gece_{mode}" in r]
        vals = [rows[i][f"gece_{mode}"] for i in idx]
        thr = np.percentile(vals, 80)
        rates[f"gece_{mode} (p80)"] = [
            float(
                np.mean(
                    [rows[i][f"gece_{mode}"] > thr for i in idx if rows[i]["bin"] == b]
                    or [float("nan")]
                )
            )
            for b in range(5)
        ]
    res["retrieval_rate_by_quintile"] = rates
    res["wrong_rate_by_quintile"] = [
        float(np.mean([r["wrong"] for r in rows if r["bin"] == b])) for b in range(5)
    ]
    res["mean_decode_s"] = float(np.mean([r["s"] for r in rows]))
    out["popqa"] = res
    out["popqa_rows"] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    _ = DIRECTION
    _plot(res, Path(args.out))


def _plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    names = list(res["auroc_wrong"])
    ax[0].barh(names, [res["auroc_wrong"][n] for n in names])
    ax[0].axvline(0.5, color="k", ls="--")
    ax[0].set_xlabel("AUROC (score predicts pure model wrong)")
    for name, r in res["retrieval_rate_by_quintile"].items():
        ax[1].plot(range(5), r, marker="o", label=name)
    ax[1].plot(range(5), res["wrong_rate_by_quintile"], "k--", label="pure model wrong")
    ax[1].set_xlabel("popularity quintile (0 = long tail)")
    ax[1].set_ylabel("retrieval rate")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "popqa_gating.png", dpi=110)


def passages_of(it: dict, k: int = 3) -> list[str]:
    ps = it["positives"][:1] + it["negatives"][:1] + it["counterfactuals"][:1]
    ps += it["negatives"][1:] + it["positives"][1:]
    return ps[:k]


def qa(lm, args, out: dict) -> None:
    from tokrag_integrations import generate
    from tokrag_integrations.gating import CtrlAGate
    from tokrag_integrations.gating.metrics import metrics_from_result

    ctrla = CtrlAGate(lm, max_new_tokens=args.max_new_tokens)
    popq = [r["question"] for r in load("popqa", 10, stratify=True)]
    ctrla.calibrate(popq, percentile=50)
    cal_conf = []
    for q in popq:
        r, _ = ctrla.monitor(q)
        cal_conf.append(metrics_from_result(r, lm.vocab_size).confidence["self_certainty"])
    conf_thr = float(np.percentile(cal_conf, 50))
    table = {}
    for name in ("squad", "rgb_en_fact", "conflictqa_strategyqa"):
        items = load(name, args.qa_limit)
        acc = {k: [] for k in ("never", "always", "confidence:self_certainty", "ctrla")}
        secs = {k: 0.0 for k in acc}
        rate = {"confidence:self_certainty": [], "ctrla": []}
        for it in items:
            t = time.perf_counter()
            r, pol = ctrla.monitor(it["question"])
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
            ok_p, ok_r = cover_em(r.text, it["answers"]), cover_em(rr.text, it["answers"])
            acc["never"].append(ok_p)
            acc["always"].append(ok_r)
            secs["never"] += t_pure
            secs["always"] += t_rag
            c = metrics_from_result(r, lm.vocab_size).confidence["self_certainty"]
            dec = {
                "confidence:self_certainty": c < conf_thr,
                "ctrla": ctrla.retrieves(ctrla.score_tokens(r.text, pol.tokens)),
            }
            for g, ret in dec.items():
                acc[g].append(ok_r if ret else ok_p)
                secs[g] += t_pure + (t_rag if ret else 0.0)
                rate[g].append(ret)
        table[name] = {
            "n": len(items),
            "accuracy": {k: float(np.mean(v)) for k, v in acc.items()},
            "seconds": secs,
            "retrieval_rate": {k: float(np.mean(v)) for k, v in rate.items()},
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--popqa-limit", type=int, default=40)
    ap.add_argument("--gece-limit", type=int, default=20)
    ap.add_argument("--gece-samples", type=int, default=2)
    ap.add_argument("--qa-limit", type=int, default=10)
    ap.add_argument("--crag-limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--parts", default="popqa,qa,crag")
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
            json.dumps({k: v for k, v in out.items() if k != "popqa_rows"}, indent=1, default=str),
            flush=True,
        )


if __name__ == "__main__":
    main()
