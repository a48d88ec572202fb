"""Cost of one source tree against another, interleaved: thread time of `rag` and `tokrag` per
question at batch 1 and tokens per thread-second in one batch of 4 (issue 55's "cost unchanged"
check of a re-layout).

    python benchmarks/tree_cost.py BEFORE_SRC AFTER_SRC [--rounds 3] [--tokens 32] [--out DIR]

BEFORE_SRC / AFTER_SRC are `src` folders of two checkouts (`git worktree add /tmp/before <commit>`).
Each round runs one child process per tree (before, then after) on the same 8 SQuAD dev
questions (5 passages each: the positive and four negatives), 8 new ones a round; one torch
thread, so thread time measures the decode's own work even on a shared machine. Each tree
gets its own copy of the cache folder (kernel plans are measured once per tree, in round 1's
warm-up). Prints the after / before ratios per round and their median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(
    os.environ.get("TOKRAG_EVAL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


def child(src: str, first: int, tokens: int) -> dict[str, float]:
    sys.path.insert(0, src)
    import torch

    torch.set_num_threads(1)
    from tokrag_integrations import generate, generate_batch, load_model

    lines = (DATA / "squad_dev.jsonl").read_text().splitlines()[first : first + 8]
    items = [json.loads(line) for line in lines]
    qs = [(it["question"], it["positives"][:1] + it["negatives"][:4]) for it in items]
    lm = load_model()
    generate(lm, qs[0][0], qs[0][1], policy="tokrag", max_new_tokens=8)  # warm-up
    out: dict[str, float] = {}
    for policy in ("rag", "tokrag"):
        t0 = time.thread_time()
        for q, p in qs[:4]:
            generate(lm, q, p, policy=policy, max_new_tokens=tokens)
        out[f"{policy} s / question, batch 1"] = (time.thread_time() - t0) / 4
        t0 = time.thread_time()
        rs = generate_batch(lm, [q for q, _ in qs[4:]], [p for _, p in qs[4:]], policy=policy,
                            max_new_tokens=tokens)  # fmt: skip
        out[f"{policy} tokens / s, batch 4"] = sum(len(r.token_ids) for r in rs) / (
            time.thread_time() - t0
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="folder for each run's JSON")
    ap.add_argument("--child", nargs=2, metavar=("SRC", "FIRST"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]), a.tokens)))
        return
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000"),
    }
    cache = Path(env.get("TOKRAG_CACHE_DIR", Path.home() / ".cache" / "tokrag"))
    work = Path(tempfile.mkdtemp(prefix="tree_cost_"))
    ratios: list[dict[str, float]] = []
    for r in range(a.rounds):
        got = {}
        for name, src in (("before", a.before), ("after", a.after)):
            tree_cache = work / f"cache_{name}"
            if not tree_cache.exists() and cache.exists():
                shutil.copytree(cache, tree_cache)
            done = subprocess.run(
                [sys.executable, __file__, a.before, a.after, "--tokens", str(a.tokens),
                 "--child", src, str(r * 8)],
                env={**env, "TOKRAG_CACHE_DIR": str(tree_cache)}, capture_output=True, text=True, check=True,
            )  # fmt: skip
            got[name] = json.loads(done.stdout.strip().splitlines()[-1])
            if a.out:
                Path(a.out).mkdir(parents=True, exist_ok=True)
                (Path(a.out) / f"{name}.{r + 1}.json").write_text(json.dumps(got[name], indent=1))
        ratios.append({k: got["after"][k] / got["before"][k] for k in got["before"]})
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios[-1].items()),
            flush=True,
        )
    print("after / before, median of rounds:")
    for k in ratios[0]:
        print(
            f"  {k}: {statistics.median(x[k] for x in ratios):.3f}  {[round(x[k], 3) for x in ratios]}"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
