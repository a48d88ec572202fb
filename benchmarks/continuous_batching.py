"""Continuous batching against batch-by-batch micro-batching, under staggered arrivals.

``n`` SQuAD dev questions (5 passages each) arrive one every ``gap`` seconds, each in its own
thread, through a fresh :class:`tokrag_integrations.engine.scheduler.MicroBatcher` of the same
loaded model: ``continuous=True`` (a call arriving mid-decode joins the running decode at
the next step) and ``continuous=False`` (it waits for the running batch to finish, then
decodes with the calls that queued meanwhile). The two modes are interleaved, the order
alternating per round. Printed per mode: mean and p95 latency (arrival to answer), the
makespan (first arrival to last answer), generated tokens per second over the makespan,
and how many calls joined a running decode. Every answer is checked against the same
question decoded alone (tokens and sources).

    OMP_NUM_THREADS=1 python benchmarks/continuous_batching.py --policy tokrag --n 8 --gap 0.5 \
        --rounds 2 --json benchmarks/results/continuous_batching.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_dev.jsonl"


def one_round(lm: Any, items: list, policy: str, gap: float, max_new_tokens: int, continuous: bool) -> dict[str, Any]:
    from tokrag_integrations.engine.scheduler import MicroBatcher

    b = MicroBatcher(lm, continuous=continuous)
    out: dict[int, Any] = {}
    done_at: dict[int, float] = {}
    t0 = time.perf_counter() + 0.05

    def call(i: int, q: str, ps: list[str]) -> None:
        time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
        out[i] = b.generate(q, ps, policy=policy, max_new_tokens=max_new_tokens)
        done_at[i] = time.perf_counter()

    threads = [threading.Thread(target=call, args=(i, q, ps)) for i, (q, ps) in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = sorted(done_at[i] - (t0 + i * gap) for i in range(len(items)))
    span = max(done_at.values()) - t0
    tokens = sum(len(out[i].trace.steps) for i in out)
    return {
        "mean_latency_s": statistics.fmean(lat),
        "p95_latency_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "makespan_s": span,
        "tokens": tokens,
        "tokens_per_s": tokens / span,
        "joined_calls": b.joined_calls,
        "peak_rows": b.peak_rows,
        "answers": {i: [(s.token_id, s.source) for s in out[i].trace.steps] for i in out},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="tokrag")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tokrag_eval.cost import bench_items
    from tokrag_integrations import generate, load_model

    lm = load_model(args.model)
    items = bench_items(SQUAD, args.n, 5)
    solo = {
        i: [(s.token_id, s.source) for s in generate(lm, q, ps, policy=args.policy, max_new_tokens=args.max_new_tokens).trace.steps]
        for i, (q, ps) in enumerate(items)
    }
    runs: dict[str, list[dict[str, Any]]] = {"continuous": [], "batch_by_batch": []}
    for r in range(args.rounds):
        modes = [True, False] if r % 2 == 0 else [False, True]
        for cont in modes:
            res = one_round(lm, items, args.policy, args.gap, args.max_new_tokens, cont)
            answers = res.pop("answers")
            exact = sum(answers[i] == solo[i] for i in solo)
            res["identical_to_solo"] = f"{exact}/{len(solo)}"
            runs["continuous" if cont else "batch_by_batch"].append(res)
            print(f"round {r} {'continuous' if cont else 'batch-by-batch'}: " + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {k: statistics.median(x[k] for x in rs) for k in ("mean_latency_s", "p95_latency_s", "makespan_s", "tokens_per_s")}
    c, b = summary["continuous"], summary["batch_by_batch"]
    print(f"\n{args.policy}, {args.n} calls one every {args.gap} s, {args.max_new_tokens} new tokens, median of {args.rounds} rounds")
    print("| mode | mean latency (s) | p95 latency (s) | makespan (s) | tokens/s |")
    print("|---|---|---|---|---|")
    for mode, s in summary.items():
        print(f"| {mode} | {s['mean_latency_s']:.2f} | {s['p95_latency_s']:.2f} | {s['makespan_s']:.2f} | {s['tokens_per_s']:.2f} |")
    print(f"continuous / batch-by-batch: mean latency {c['mean_latency_s'] / b['mean_latency_s']:.2f}, "
          f"tokens/s {c['tokens_per_s'] / b['tokens_per_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
