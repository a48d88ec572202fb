"""Which layers of attention cite an answer's passage best (issue 46), against two baselines.

For each dev question (SQuAD and RGB, one positive passage among k in random order:
``mix_passages(item, noise, k)``), the answer is decoded with ``tokrag`` and, at every generated
step, the attention row of the RAG context's generating position is read at every layer and
turned into per-passage masses (head-mean raw mass, and the per-head renormalised Att of
Eq. 15). For answers that contain the gold answer (cover EM), the answer span is the tokens of
the gold answer inside the generated text; a variant cites the span to the passage with the
largest score summed over those tokens (each step's scores normalised over passages). The
citation is correct when that passage holds a gold answer. Baselines on the same answers:
the top-ranked passage (the first of the mix), and the passage most similar to the answer's
sentence by the packaged MiniLM embedder.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/citations.py --squad 180 --offset 120 --rgb 50 \
        --max-new-tokens 16

Prints one row per variant: correct / n, the share and its 95 % Wilson interval, per set.

``--cost N``: instead, the cost of citations: N SQuAD questions (same mixes) decoded with
citations on and off, interleaved (the order alternating per question), for ``tokrag`` and
``rag``; prints ms per generated token (decode time only) and on/off.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import torch

from tokrag_integrations import generate, load_model
from tokrag_integrations.attention.citations import citation_layers
from tokrag_integrations.evaluation.data import load_items, mix_passages
from tokrag_integrations.evaluation.metrics import cover_em
from tokrag_integrations.policies.tokrag import TokRAG
from tokrag_integrations.retrieval.embedder import load_embedder

DATA = Path(__file__).resolve().parents[1] / "../shared/data"


class Recording(TokRAG):
    """``tokrag`` that also keeps, per step, every layer's per-passage attention masses."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []
        self.steps: list[dict[str, Any]] = []

    def contexts(self, plan: Any) -> Any:
        self.lengths = [e - s for s, e in plan.passage_spans]
        return super().contexts(plan)

    def choose(self, views: Any, lens: Any) -> Any:
        out = super().choose(views, lens)
        for v, c in zip(views, out, strict=True):
            rag = v["rag"]
            attn = rag.attention_all().float()  # [L, H, T]
            spans = list(rag.rt_positions.split(self.lengths))
            rt = rag.rt_positions
            head_mean = attn.mean(1)  # [L, T]
            mass = torch.stack([head_mean[:, p].sum(-1) for p in spans], -1)  # [L, P]
            sub = attn[:, :, rt]
            per_head = sub / sub.sum(-1, keepdim=True).clamp_min(1e-30)
            renorm = per_head.mean(1).split(self.lengths, -1)
            renorm_m = torch.stack([r.sum(-1) for r in renorm], -1)  # [L, P]
            f = head_mean[:, rt].sum(-1)  # f(l) of Eq. 14
            lo = self._lo - 1
            word = (~self._pr_skip[rag.rt_token_ids]).float()  # 0 at punctuation
            nopunct = torch.stack(
                [
                    (head_mean[:, p] * w).sum(-1)
                    for p, w in zip(spans, word.split(self.lengths), strict=True)
                ],
                -1,
            )
            self.steps.append(
                {
                    "mass": mass,
                    "renorm": renorm_m,
                    "nopunct": nopunct,
                    "l_star": c.signals.get("l_star"),
                    "f_arg": lo + int(f[lo:].argmax()),
                }
            )
        return out


def _layers(name: str, n: int, step: dict[str, Any]) -> list[int]:
    if name == "l*":  # the step's l* where Eq. 14 ran, else the attention term's argmax
        ls = step["l_star"]
        return [int(ls) - 1] if ls is not None else [step["f_arg"]]
    if name == "argmax f":
        return [step["f_arg"]]
    if name.startswith("layer "):
        return [int(name.split()[1]) - 1]
    if name == "0.6L-0.8L":
        return citation_layers(n, "upper-middle")
    return {
        "last": [n - 1],
        "last4": list(range(n - 4, n)),
        "upper": list(range(n // 2, n)),
        "all": list(range(n)),
    }[name]


def _cite(steps: list[dict[str, Any]], span: range, layers: str, agg: str) -> int:
    total = None
    for i in span:
        s = steps[i]
        m = torch.as_tensor(s[agg])
        row = m[_layers(layers, m.shape[0], s)].mean(0)
        row = row / row.sum().clamp_min(1e-30)
        total = row if total is None else total + row
    assert total is not None
    return int(total.argmax())


def _span(texts: list[str], answers: list[str]) -> range | None:
    """Token indices overlapping the first gold answer found in the generated text."""
    full = "".join(texts)
    low = full.lower()
    for a in sorted(answers, key=len, reverse=True):
        at = low.find(a.lower().strip())
        if at < 0:
            continue
        end, pos, idx = at + len(a.strip()), 0, []
        for i, t in enumerate(texts):
            if pos < end and pos + len(t) > at:
                idx.append(i)
            pos += len(t)
        return range(idx[0], idx[-1] + 1)
    return None


def _sentence(text: str, texts: list[str], span: range) -> str:
    start = len("".join(texts[: span.start]))
    end = len("".join(texts[: span.stop]))
    lo = max([m.end() for m in re.finditer(r"[.!?\n]\s", text[:start])], default=0)
    hi = re.search(r"[.!?\n]", text[end:])
    return text[lo : end + (hi.end() if hi else len(text) - end)].strip()


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (c - h, c + h)


VARIANTS = [
    (lay, agg)
    for agg in ("mass", "renorm", "nopunct")
    for lay in ("l*", "argmax f", "last", "last4", "upper", "0.6L-0.8L", "all")
]


def decode_set(
    lm: Any, emb: Any, path: Path, limit: int, offset: int, noise: float, k: int, tokens: int
) -> list[dict]:
    """One record per question: whether the answer holds the gold answer and, if so, the
    gold passages, the baselines' picks, the engine's own citation and the span's steps."""
    records = []
    for it in load_items(path, offset + limit)[offset:]:
        mix = mix_passages(it, noise, k)
        pol = Recording()
        r = generate(lm, it.question, mix.passages, policy=pol, max_new_tokens=tokens)
        rec: dict[str, Any] = {"id": it.id, "answer": r.text, "em": cover_em(r.text, it.answers)}
        records.append(rec)
        texts = [s.text for s in r.trace.steps]
        span = _span(texts, it.answers) if rec["em"] else None
        gold = [j for j, p in enumerate(mix.passages) if cover_em(p, it.answers)]
        if span is None or not gold:
            continue
        sent = _sentence(r.text, texts, span)
        e = emb.encode([sent, *mix.passages])
        cited = r.trace.cite(span.start, span.stop)
        steps = [
            {
                key: (v.tolist() if isinstance(v, torch.Tensor) else v)
                for key, v in pol.steps[i].items()
            }
            for i in span
        ]
        rec.update(
            gold=gold,
            top_ranked=0,
            embedder=int((e[1:] @ e[0]).argmax()),
            engine=None if cited is None else cited[0],
            steps=steps,
        )
    return records


def score_set(records: list[dict]) -> dict:
    """Hits per variant and baseline over the records with a span."""
    rows = [r for r in records if "steps" in r]
    hits: dict[str, int] = {}
    n_layers = len(rows[0]["steps"][0]["mass"]) if rows else 0
    names = VARIANTS + [(f"layer {i + 1}", "mass") for i in range(n_layers)]
    for r in rows:
        gold = set(r["gold"])
        span = range(len(r["steps"]))
        for lay, agg in names:
            key = f"{agg}:{lay}"
            hits[key] = hits.get(key, 0) + (_cite(r["steps"], span, lay, agg) in gold)
        for b in ("engine", "top_ranked", "embedder"):
            hits[f"baseline:{b}"] = hits.get(f"baseline:{b}", 0) + (r[b] in gold)
    skipped = sum(1 for r in records if r["em"] and "steps" not in r)
    return {"n": len(rows), "skipped": skipped, "questions": len(records), "hits": hits}


def run_cost(lm: Any, path: Path, n: int, noise: float, k: int, tokens: int) -> None:
    items = load_items(path, n)
    for policy in ("tokrag", "rag"):
        t = {True: 0.0, False: 0.0}
        toks = {True: 0, False: 0}
        for i, it in enumerate(items):
            mix = mix_passages(it, noise, k)
            for on in (True, False) if i % 2 else (False, True):
                r = generate(
                    lm,
                    it.question,
                    mix.passages,
                    policy=policy,
                    max_new_tokens=tokens,
                    stop=[],
                    citations=on,
                )
                t[on] += r.trace.timings["decode_s"]
                toks[on] += len(r.trace.steps)
        ms = {on: 1000 * t[on] / max(toks[on], 1) for on in t}
        print(
            f"{policy}: citations on {ms[True]:.2f} ms/token, off {ms[False]:.2f} ms/token, "
            f"on/off {ms[True] / ms[False]:.3f} ({n} questions, {toks[True]} tokens each way)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--squad", type=int, default=80, help="SQuAD dev questions")
    ap.add_argument("--rgb", type=int, default=50, help="RGB dev questions")
    ap.add_argument(
        "--noise", type=float, default=0.8, help="noise ratio (0.8, k=5: 1 pos + 4 neg)"
    )
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--offset", type=int, default=0, help="skip the first N SQuAD questions")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--records", type=Path, default=None, help="write the records (JSON)")
    ap.add_argument(
        "--from-records",
        type=Path,
        nargs="*",
        default=None,
        help="score these records files (merged per set) instead of decoding",
    )
    ap.add_argument("--cost", type=int, default=0, help="measure the cost on N questions")
    a = ap.parse_args()
    torch.manual_seed(0)
    out: dict[str, list[dict]] = {}
    t0 = time.time()
    if a.from_records:
        for f in a.from_records:
            for name, recs in json.loads(f.read_text()).items():
                out.setdefault(name, []).extend(recs)
    else:
        lm = load_model("default")
        if a.cost:
            run_cost(lm, a.data / "squad_dev.jsonl", a.cost, a.noise, a.k, a.max_new_tokens)
            return
        emb = load_embedder()
        for name, file, limit, offset in (
            ("squad", "squad_dev.jsonl", a.squad, a.offset),
            ("rgb", "rgb_en_fact_dev.jsonl", a.rgb, 0),
        ):
            if limit:
                out[name] = decode_set(
                    lm, emb, a.data / file, limit, offset, a.noise, a.k, a.max_new_tokens
                )
        if a.records:
            a.records.write_text(json.dumps(out))
    scored = {name: score_set(recs) for name, recs in out.items()}
    print(f"noise {a.noise}, k {a.k}, max_new_tokens {a.max_new_tokens}, {time.time() - t0:.0f} s")
    head = " | ".join(
        f"{s} ({scored[s]['questions']} questions, n={scored[s]['n']}, no span {scored[s]['skipped']})"
        for s in scored
    )
    print(f"| variant | {head} |")
    for key in next(iter(scored.values()))["hits"]:
        cells = []
        for s in scored:
            h, n = scored[s]["hits"].get(key, 0), scored[s]["n"]
            lo, hi = wilson(h, n)
            cells.append(f"{h}/{n} = {h / max(n, 1):.2f} [{lo:.2f}, {hi:.2f}]")
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
