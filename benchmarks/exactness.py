"""Evidence for issue 8: every fast path gives the step-by-step tokens and decisions.

Questions from the dev sets with the evaluation harness's noisy passages
(``evaluation.data.mix_passages``: 5 passages, noise ratio cycling through 0.2/0.4/0.6/0.8,
so the answer-bearing passage competes with hard negatives). The reference is ``tokrag``'s
step-by-step loop as written (``speed="reference"``: one forward pass per context).
Compared with it, one query at a time:

* ``fused``: the default: for one query, both contexts packed into one sequence (one
  prefill pass, one pass of two positions per step);
* ``unpacked``: the same with ``TOKRAG_PACKED_PREFILL=0`` (each context prefilled on its own,
  then both as a two-row batch per step, as a batch of several queries decodes);
* ``stock``: the step-by-step loop on the same model with transformers' stock CPU kernels
  (``TOKRAG_CPU_KERNELS=off``), to check that the few-row kernels change no decision;

and (``--batch N``) ``fused`` again with N questions per batch. Per step the
token id, source and the decision signals (``benefit``, ``l_star``) must be equal; for
``cos_ir``/``cos_llm`` the largest absolute difference is reported.

    OMP_NUM_THREADS=1 python benchmarks/exactness.py --per-set 20 --batch 4 \
        --json benchmarks/results/exactness.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SETS = ("squad", "rgb_en_fact", "conflictqa_strategyqa")
RATIOS = (0.2, 0.4, 0.6, 0.8)


def steps_of(result: Any) -> list[dict[str, Any]]:
    return [
        {
            "token": s.token_id,
            "source": s.source,
            **{k: s.signals.get(k) for k in ("benefit", "l_star", "cos_ir", "cos_llm")},
        }
        for s in result.trace.steps
    ]


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Tokens and decisions (token, source, benefit, l*) must be equal; the cosines are
    compared by their largest absolute difference (float rounding of block passes)."""
    first = None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if any(x[k] != y[k] for k in ("token", "source", "benefit", "l_star")):
            first = i
            break
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    cos = [
        abs(x[k] - y[k])
        for x, y in zip(a, b, strict=False)
        for k in ("cos_ir", "cos_llm")
        if x[k] is not None and y[k] is not None
    ]
    return {
        "identical": first is None,
        "first_difference": first,
        "max_cos_diff": max(cos, default=0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-set", type=int, default=20, help="questions per dev set")
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--batch",
        default="4",
        help="also decode the fast paths in batches of N (a comma list: each size; 0: skip)",
    )
    ap.add_argument(
        "--arms",
        default="fused,unpacked,stock",
        help="comma list of fused, unpacked, stock",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--data-dir", default=str(DATA), help="folder of the dev sets' JSONL files")
    ap.add_argument(
        "--full", action="store_true", help="also write every step of every decode to --json"
    )
    args = ap.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]

    from tokrag_eval.data import load_items, mix_passages
    from tokrag_integrations import generate, generate_batch, load_model

    lm = load_model("default", device="cpu")
    cases = []
    for name in args.sets.split(","):
        for i, it in enumerate(load_items(Path(args.data_dir) / f"{name}_dev.jsonl", args.per_set)):
            mix = mix_passages(it, RATIOS[i % len(RATIOS)], k=5)
            if mix.passages:
                cases.append((f"{name}:{it.id}", it.question, mix.passages))

    stock = None
    if "stock" in args.arms:
        os.environ["TOKRAG_CPU_KERNELS"] = "off"
        stock = load_model("default", device="cpu")
        del os.environ["TOKRAG_CPU_KERNELS"]
    arms = {
        "fused": (lm, {"speed": "auto"}),
        "unpacked": (lm, {"speed": "auto"}),
        "stock": (stock, {"speed": "reference"}),
    }
    arms = {k: v for k, v in arms.items() if k in args.arms}
    ref_opts = {"speed": "reference"}

    rows = []
    seconds = {"step": 0.0, **dict.fromkeys(arms, 0.0)}
    for cid, q, ps in tqdm(cases, desc="step vs " + ", ".join(arms)):
        t0 = time.perf_counter()
        ref = generate(lm, q, ps, policy="tokrag", max_new_tokens=args.max_new_tokens, **ref_opts)
        seconds["step"] += time.perf_counter() - t0
        a = steps_of(ref)
        row = {
            "id": cid,
            "tokens": len(a),
            "disagreements": sum(1 for s in ref.trace.steps if s.disagreement),
            "ref": a,
        }
        for name, (model, opts) in arms.items():
            if name == "unpacked":
                os.environ["TOKRAG_PACKED_PREFILL"] = "0"
            t0 = time.perf_counter()
            try:
                r = generate(model, q, ps, policy="tokrag", max_new_tokens=args.max_new_tokens, **opts)
            finally:
                os.environ.pop("TOKRAG_PACKED_PREFILL", None)
            seconds[name] += time.perf_counter() - t0
            row[name] = compare(a, steps_of(r))
        rows.append(row)

    batched: dict[str, list[dict[str, Any]]] = {}
    sizes = [int(x) for x in str(args.batch).split(",") if x.strip() and int(x) > 0]
    for size in sizes:
        for name in ("fused",):
            if name not in arms:
                continue
            opts = arms[name][1]
            for i in tqdm(range(0, len(cases), size), desc=f"{name}, batches of {size}"):
                chunk = cases[i : i + size]
                res = generate_batch(
                    lm,
                    [q for _, q, _ in chunk],
                    [ps for _, _, ps in chunk],
                    policy="tokrag",
                    max_new_tokens=args.max_new_tokens,
                    **opts,
                )
                for j, r in enumerate(res):
                    cmp = compare(rows[i + j]["ref"], steps_of(r))
                    batched.setdefault(f"{name}_batch{size}", []).append({"id": rows[i + j]["id"], **cmp})

    n = len(rows)
    tokens = sum(r["tokens"] for r in rows)
    dis = sum(r["disagreements"] for r in rows)
    per_arm = {
        name: {
            "identical": sum(r[name]["identical"] for r in rows),
            "max_cos_diff": max(r[name]["max_cos_diff"] for r in rows),
            "differences": [
                {"id": r["id"], "step": r[name]["first_difference"]}
                for r in rows
                if not r[name]["identical"]
            ],
        }
        for name in arms
    }
    for name, bs in batched.items():
        per_arm[name] = {
            "identical": sum(b["identical"] for b in bs),
            "max_cos_diff": max(b["max_cos_diff"] for b in bs),
            "differences": [
                {"id": b["id"], "step": b["first_difference"]} for b in bs if not b["identical"]
            ],
        }
    summary = {
        "questions": n,
        "tokens": tokens,
        "disagreement_steps": dis,
        "agreement_rate": 1 - dis / max(1, tokens),
        "arms": per_arm,
        "seconds": seconds,
        "threads": __import__("torch").get_num_threads(),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        keep = rows if args.full else [{k: v for k, v in r.items() if k != "ref"} for r in rows]
        Path(args.json).write_text(
            json.dumps({"summary": summary, "rows": keep}, indent=1), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
