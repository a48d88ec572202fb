"""A batch's prompts prefilled together against a few at a time (``TOKRAG_SPLIT_PREFILL``).

For each batch size, ``rag`` and ``tokrag`` decode the same SQuAD dev questions (5 passages
each) with ``generate_batch``, once with the prompts prefilled as one padded batch
(``TOKRAG_SPLIT_PREFILL=0``) and once prefilled a few at a time and merged (the CPU
default); the four runs of a size are interleaved, their order rotated from one size and
round to the next. Printed per run: seconds, generated tokens, tokens/s and the prefill's
seconds; then per size the tokens/s ratios (split / together per arm, ``tokrag`` / ``rag``
per mode). The switch is read per call, so every run shares one loaded model.

    python benchmarks/split_prefill.py --sizes 4,16 --rounds 1 \
        --json benchmarks/results/split_prefill.json

``--prompts samples`` decodes the packaged sample questions with their BM25 top-3 chunks
instead (the prompts of ``benchmarks/load_serve.py``); ``--max-new-tokens 1`` times the
prefill alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/squad_dev.jsonl"))
    ap.add_argument("--sizes", default="4,16")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", choices=("squad", "samples"), default="squad")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tokrag_eval.cost import bench_items
    from tokrag_integrations.engine.scheduler import generate_batch
    from tokrag_integrations.models import load_model

    sizes = [int(x) for x in args.sizes.split(",")]
    lm = load_model("default")
    pool = max(sizes) * args.rounds
    if args.prompts == "samples":
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from load_serve import workload

        items = workload()
    else:
        items = bench_items(args.data, pool, 5)
    generate_batch(lm, [items[0][0]], [items[0][1]], policy="tokrag", max_new_tokens=2)  # warm-up
    runs: list[dict[str, Any]] = []
    turn = 0
    before = os.environ.get("TOKRAG_SPLIT_PREFILL")
    try:
        for r in range(args.rounds):
            for n in sizes:
                batch = [items[(r * n + i) % len(items)] for i in range(n)]
                combos = [(split, arm) for split in ("0", "1") for arm in ("rag", "tokrag")]
                combos = combos[turn % 4 :] + combos[: turn % 4]
                turn += 1
                for split, arm in combos:
                    os.environ["TOKRAG_SPLIT_PREFILL"] = split
                    t0 = time.perf_counter()
                    out = generate_batch(
                        lm, [q for q, _ in batch], [p for _, p in batch], policy=arm,
                        max_new_tokens=args.max_new_tokens,
                    )
                    dt = time.perf_counter() - t0
                    tokens = sum(len(x.trace.steps) for x in out)
                    row = {
                        "round": r, "n": n, "split": split == "1", "arm": arm, "seconds": dt,
                        "tokens": tokens, "tokens_per_s": tokens / dt,
                        "prefill_s": out[0].trace.timings.get("prefill_s", 0.0),
                    }
                    runs.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if before is None:
            os.environ.pop("TOKRAG_SPLIT_PREFILL", None)
        else:
            os.environ["TOKRAG_SPLIT_PREFILL"] = before

    def tps(n: int, split: bool, arm: str) -> float:
        rs = [x for x in runs if x["n"] == n and x["split"] == split and x["arm"] == arm]
        return sum(x["tokens"] for x in rs) / sum(x["seconds"] for x in rs)

    print("\n| batch | arm | tokens/s together | tokens/s split | split / together |")
    print("| --- | --- | --- | --- | --- |")
    summary = {}
    for n in sizes:
        for arm in ("rag", "tokrag"):
            a, b = tps(n, False, arm), tps(n, True, arm)
            summary[f"{n}:{arm}"] = {"together": a, "split": b}
            print(f"| {n} | {arm} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
        for split in (False, True):
            print(f"| {n} | tokrag / rag, {'split' if split else 'together'} | | | "
                  f"{tps(n, split, 'tokrag') / tps(n, split, 'rag'):.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
