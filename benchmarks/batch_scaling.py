"""Tokens/s against batch size for ``rag`` and ``tokrag``, the memory of one more row, and
the share of the memory-bandwidth floor that a one-query step reaches (issue 33).

* Tokens/s: ``generate_batch`` on ``n`` SQuAD dev questions (5 passages each) per batch
  size, the two arms interleaved (the order alternates from one size and round to the next).
* Memory per extra row: the KV cache allocated by the prefill of a batch (the engine's
  buffers, padding and spare capacity included) divided by its rows, per query (one row for
  ``rag``, two for ``tokrag``), measured at batch 4 and 8 and given as the difference per
  query.
* Bandwidth floor at batch 1: a step reads every weight once, so it cannot take less than
  (bytes of the weights) / (memory bandwidth); the bandwidth is that of summing a 1 GiB
  float32 tensor (best of 5), the step time is ``rag``'s decode seconds per token at batch
  1 (prefill excluded).

    OMP_NUM_THREADS=1 python benchmarks/batch_scaling.py --sizes 1,2,4,8,16,32 \
        --json benchmarks/results/batch_scaling.json --plot docs/img/batch_scaling.png
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

ARMS = ("rag", "tokrag")
SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_dev.jsonl"


def _kv_bytes(ready: Any) -> int:
    total = 0
    for b in ready.batches.values():
        for layer in b.cache.layers:
            for buf in (getattr(layer, "_kbuf", None), getattr(layer, "_vbuf", None)):
                if buf is not None:
                    total += buf.numel() * buf.element_size()
    return total


def kv_per_query(lm: Any, items: list[tuple[str, list[str]]], policy: str, n: int) -> float:
    """KV-cache bytes per query after the prefill of a batch of ``n`` queries."""
    import torch

    from tokrag_integrations.engine.decoder import role_setup
    from tokrag_integrations.engine.seam import SpeedPaths
    from tokrag_integrations.policies import get_policy
    from tokrag_integrations.prompts import PromptBuilder
    from tokrag_integrations.speed import speed_of

    pol = get_policy(policy)
    builder = PromptBuilder(lm.tokenizer, context_window=lm.context_window)
    plans = [builder.build(q, ps) for q, ps in items[:n]]
    per_query, roles, probe = role_setup(lm, plans, pol)
    paths = SpeedPaths(lm, speed_of(None))  # the prefill a decode with default speed runs
    with torch.inference_mode(), paths.scope():
        ready = paths.prefill(roles, per_query, lm, probe)
    return _kv_bytes(ready) / n


def bandwidth_gbs() -> float:
    import torch

    x = torch.ones(2**28)  # 1 GiB of float32
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]

    import torch

    from tokrag_eval.cost import bench_items
    from tokrag_integrations import generate_batch, load_model
    from tokrag_integrations.accel.install import speed_paths

    lm = load_model("default", device="cpu")
    items = bench_items(SQUAD, max(8, max(sizes) * args.rounds))
    generate_batch(lm, [items[0][0]], [items[0][1]], policy="tokrag", max_new_tokens=2)  # warm-up
    raw: dict[str, dict[int, list[tuple[int, float, float]]]] = {a: {n: [] for n in sizes} for a in ARMS}
    turn = 0
    for r in range(args.rounds):
        for n in sizes:
            batch = [items[(r * n + i) % len(items)] for i in range(n)]
            order = ARMS if turn % 2 == 0 else ARMS[::-1]
            turn += 1
            for name in order:
                t0 = time.perf_counter()
                rs = generate_batch(
                    lm, [q for q, _ in batch], [p for _, p in batch], policy=name,
                    max_new_tokens=args.max_new_tokens,
                )
                dt = time.perf_counter() - t0
                tokens = sum(len(x.trace.steps) for x in rs)
                decode = rs[0].trace.timings.get("decode_s", float("nan"))
                raw[name][n].append((tokens, dt, decode))
                print(f"batch {n} {name}: {tokens / dt:.2f} tokens/s", flush=True)
    tps = {
        a: {n: sum(t for t, _, _ in v) / sum(d for _, d, _ in v) for n, v in per.items()}
        for a, per in raw.items()
    }
    out: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "tokens_per_s": {a: {str(n): v for n, v in per.items()} for a, per in tps.items()},
        "ratio_tokrag_rag": {str(n): tps["tokrag"][n] / tps["rag"][n] for n in sizes},
        "paths": speed_paths(lm.model),
    }
    # Memory of one more query: the KV cache per query at batch 4 and 8, and the difference.
    kv = {}
    for a in ARMS:
        b4, b8 = kv_per_query(lm, items, a, 4), kv_per_query(lm, items, a, 8)
        kv[a] = {"per_query_mb_batch4": b4 / 2**20, "per_query_mb_batch8": b8 / 2**20}
    out["kv_cache_per_query"] = kv
    # Bandwidth floor at batch 1.
    if 1 in sizes:
        weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        gbs = bandwidth_gbs()
        steps = [(t - 1, dec) for t, _, dec in raw["rag"][1] if t > 1]
        step_s = sum(d for _, d in steps) / max(1, sum(t for t, _ in steps))
        floor_s = weights / (gbs * 1e9)
        out["bandwidth_floor"] = {
            "weights_mb": weights / 2**20,
            "bandwidth_gb_s": gbs,
            "floor_ms_per_step": 1000 * floor_s,
            "rag_ms_per_decode_step": 1000 * step_s,
            "fraction_of_floor": floor_s / step_s if step_s else float("nan"),
        }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1), encoding="utf-8")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for a in ARMS:
            ax.plot(sizes, [tps[a][n] for n in sizes], marker="o", label=a)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("queries per batch")
        ax.set_ylabel("generated tokens / s")
        ax.set_title(f"SmolLM2-135M, CPU, {torch.get_num_threads()} thread(s)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
