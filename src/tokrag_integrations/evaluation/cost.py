"""Cost (Tok-RAG Table 6 protocol): time per question and peak memory per policy.

Each policy runs in its own subprocess so that peak memory is not shared between policies:
the child loads the model, answers one warm-up question with ``llm``, reads its peak resident
set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), then answers the measured questions
one at a time under the policy. Reported: mean wall time per question and the growth of the
peak RSS above the post-warm-up level (on CUDA also ``torch.cuda.max_memory_allocated``).

    python -m tokrag_integrations.evaluation.cost --policy tokrag --data D.jsonl --limit 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from .data import DEFAULT_SEED, load_items, mix_passages
from .specs import parse_spec


def _measure(model: str, data: str, policy: str, limit: int, k: int, ratio: float, max_new_tokens: int, device: str | None) -> dict[str, Any]:
    import torch

    from ..batching import generate
    from ..models import load_model

    warnings.simplefilter("ignore")
    spec = parse_spec(policy)  # a name or name[key=value,...]
    lm = load_model(model, device=device) if device else load_model(model)
    items = load_items(data, limit=limit)
    mixes = [mix_passages(it, ratio, k=k, seed=DEFAULT_SEED).passages for it in items]
    generate(lm, items[0].question, None, policy="llm", max_new_tokens=4)
    cuda = torch.cuda.is_available() and str(lm.device).startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.max_memory_allocated()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times, tokens, prefill = [], [], []
    for it, ps in zip(items, mixes, strict=True):
        t0 = time.perf_counter()
        r = generate(lm, it.question, ps, policy=spec.name, max_new_tokens=max_new_tokens, stop=["\n"], policy_options=spec.options)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens.append(len(r.token_ids))
        prefill.append(r.trace.timings.get("prefill_s", 0.0))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {
        "policy": policy,
        "n": len(items),
        "time_per_question_s": sum(times) / len(times),
        "prefill_per_question_s": sum(prefill) / len(prefill),
        "tokens_per_question": sum(tokens) / len(tokens),
        "peak_rss_mb": peak / 1024,
        "peak_rss_growth_mb": (peak - base) / 1024,
        "device": str(lm.device),
        "threads": torch.get_num_threads(),
    }
    if cuda:
        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_peak_growth_mb"] = (torch.cuda.max_memory_allocated() - base_cuda) / 2**20
    return out


def measure_costs(
    policies: Sequence[str],
    *,
    data: str,
    model: str = "default",
    limit: int = 3,
    k: int = 5,
    ratio: float = 0.4,
    max_new_tokens: int = 24,
    device: str | None = None,
    nice: int = 0,
) -> dict[str, Any]:
    """Run one subprocess per policy; returns {"policies": {name: figures}, "ratios": {...}}."""
    res: dict[str, Any] = {}
    for p in policies:
        cmd = [sys.executable, "-m", __name__, "--policy", p, "--data", str(data), "--model", model,
               "--limit", str(limit), "--k", str(k), "--ratio", str(ratio), "--max-new-tokens", str(max_new_tokens)]
        if device:
            cmd += ["--device", device]
        if nice:
            cmd = ["nice", "-n", str(nice), *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        if proc.returncode != 0:
            raise RuntimeError(f"cost run for {p!r} failed:\n{proc.stderr[-2000:]}")
        res[p] = json.loads(proc.stdout.strip().splitlines()[-1])
    ratios: dict[str, dict[str, float]] = {}
    if "rag" in res:
        r0 = res["rag"]
        for p, v in res.items():
            ratios[p] = {
                "time_vs_rag": v["time_per_question_s"] / r0["time_per_question_s"],
                "peak_rss_vs_rag": v["peak_rss_mb"] / r0["peak_rss_mb"],
            }
    return {"policies": res, "vs_rag": ratios, "limit": limit, "k": k, "ratio": ratio, "max_new_tokens": max_new_tokens}


def cost_table(summary: dict[str, Any]) -> str:
    lines = [
        "| policy | s / question | prefill s | tokens | peak RSS MB | RSS growth MB | time ×rag | peak ×rag |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p, v in summary["policies"].items():
        r = summary["vs_rag"].get(p, {})
        lines.append(
            f"| {p} | {v['time_per_question_s']:.2f} | {v['prefill_per_question_s']:.2f} | {v['tokens_per_question']:.1f} | "
            f"{v['peak_rss_mb']:.0f} | {v['peak_rss_growth_mb']:.0f} | {r.get('time_vs_rag', float('nan')):.2f} | "
            f"{r.get('peak_rss_vs_rag', float('nan')):.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True, help="policy spec: name or name[key=value,...]")
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--ratio", type=float, default=0.4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    print(json.dumps(_measure(a.model, a.data, a.policy, a.limit, a.k, a.ratio, a.max_new_tokens, a.device)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
