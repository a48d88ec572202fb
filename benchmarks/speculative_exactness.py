"""Evidence for issue 8: blockwise Tok-RAG gives the step-by-step tokens and decisions.

Questions from the dev sets with the evaluation harness's noisy passages
(``evaluation.data.mix_passages``: 5 passages, noise ratio cycling through 0.2/0.4/0.6/0.8,
so the answer-bearing passage competes with hard negatives). Each question is decoded by
step-by-step ``tokrag`` (``speculative=False``) and by the blockwise default, one query at a
time, and (``--batch N``) the blockwise loop also decodes the same questions N at a time.
Compared per step: token id, source and the decision signals (``benefit``, ``l_star``) must be
equal; for ``cos_ir``/``cos_llm`` the largest absolute difference is reported. Prints the
counts, the blockwise statistics and the wall times.

    OMP_NUM_THREADS=1 python benchmarks/speculative_exactness.py --per-set 20 --batch 4 \
        --json benchmarks/results/speculative_exactness.json
"""

from __future__ import annotations

import argparse
import json
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
        "--batch", type=int, default=4, help="also decode blockwise in batches of N (0: skip)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--full", action="store_true", help="also write every step of every decode to --json"
    )
    args = ap.parse_args()

    from tokrag_integrations import generate, generate_batch, load_model
    from tokrag_integrations.evaluation.data import load_items, mix_passages

    lm = load_model("default", device="cpu")
    cases = []
    for name in args.sets.split(","):
        for i, it in enumerate(load_items(DATA / f"{name}_dev.jsonl", args.per_set)):
            mix = mix_passages(it, RATIOS[i % len(RATIOS)], k=5)
            if mix.passages:
                cases.append((f"{name}:{it.id}", it.question, mix.passages))

    rows = []
    t_step = t_fast = 0.0
    counts = {k: 0.0 for k in ("blocks", "drafted", "accepted", "verifier_wins", "stale")}
    for cid, q, ps in tqdm(cases, desc="step vs blockwise"):
        t0 = time.perf_counter()
        ref = generate(
            lm, q, ps, policy="tokrag", speculative=False, max_new_tokens=args.max_new_tokens
        )
        t1 = time.perf_counter()
        fast = generate(lm, q, ps, policy="tokrag", max_new_tokens=args.max_new_tokens)
        t2 = time.perf_counter()
        t_step += t1 - t0
        t_fast += t2 - t1
        for k in counts:
            counts[k] += fast.trace.timings.get(k, 0.0)
        a, b = steps_of(ref), steps_of(fast)
        rows.append(
            {
                "id": cid,
                **compare(a, b),
                "tokens": len(a),
                "disagreements": sum(1 for s in ref.trace.steps if s.disagreement),
                "ref": a,
                "fast": b,
            }
        )

    batched = []
    if args.batch:
        for i in tqdm(range(0, len(cases), args.batch), desc=f"blockwise, batches of {args.batch}"):
            chunk = cases[i : i + args.batch]
            res = generate_batch(
                lm,
                [q for _, q, _ in chunk],
                [ps for _, _, ps in chunk],
                policy="tokrag",
                max_new_tokens=args.max_new_tokens,
            )
            for j, r in enumerate(res):
                cmp = compare(rows[i + j]["ref"], steps_of(r))
                batched.append({"id": rows[i + j]["id"], **cmp})
                rows[i + j]["batched"] = steps_of(r)

    n = len(rows)
    tokens = sum(r["tokens"] for r in rows)
    dis = sum(r["disagreements"] for r in rows)
    summary = {
        "questions": n,
        "identical": sum(r["identical"] for r in rows),
        "max_cos_diff": max(r["max_cos_diff"] for r in rows),
        "batched_identical": sum(b["identical"] for b in batched) if batched else None,
        "batched_max_cos_diff": max((b["max_cos_diff"] for b in batched), default=None),
        "batch": args.batch,
        "tokens": tokens,
        "disagreement_steps": dis,
        "agreement_rate": 1 - dis / max(1, tokens),
        "tokens_per_block": (tokens - n) / max(1, counts["blocks"]),
        "draft_acceptance": counts["accepted"] / max(1, counts["drafted"]),
        **counts,
        "seconds_step": t_step,
        "seconds_blockwise": t_fast,
        "differences": [
            {"id": r["id"], "step": r["first_difference"]} for r in rows if not r["identical"]
        ],
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        keep = (
            rows
            if args.full
            else [{k: v for k, v in r.items() if k not in ("ref", "fast", "batched")} for r in rows]
        )
        Path(args.json).write_text(
            json.dumps({"summary": summary, "rows": keep}, indent=1), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
