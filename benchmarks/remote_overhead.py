"""What an app worker pays for decoding on a ``tokrag serve`` server instead of in-process.

Starts ``tokrag serve`` (the packaged model) in a subprocess, loads the same model here, and
asks SQuAD dev questions with their passages (the gold one and two others) through
``TokRAGLLM(lm)`` and ``TokRAGLLM(base_url=...)``, interleaved (per question: local then
remote in even rounds, remote then local in odd ones), one call at a time, so both decode on
the whole machine. Prints the median time per question of each, the median of the per-question
difference (remote - local), the same for the time outside the engine (wall time less the
trace's ``total_s``: HTTP, JSON of the full trace, parsing; what the client adds whatever the
two processes' decode speeds) and whether every answer and token source is the same.

    python benchmarks/remote_overhead.py                      # 10 questions x 4 rounds
    python benchmarks/remote_overhead.py --questions 10 --rounds 4 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tokrag_eval.data import load_items
from tokrag_integrations import load_model
from tokrag_integrations.llama_index import TokRAGLLM

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "squad_dev.jsonl"


def _serve(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        cmd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokrag serve exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"tokrag serve did not become healthy; see {log}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()

    items = load_items(args.data, limit=args.questions)
    asks = [(it.question, [*it.positives[:1], *it.negatives[:2]]) for it in items]
    proc, url = _serve(Path("remote_overhead.serve.log"))
    try:
        local = TokRAGLLM(load_model("default"), max_new_tokens=args.max_new_tokens)
        remote = TokRAGLLM(base_url=url, max_new_tokens=args.max_new_tokens)
        remote.complete(*asks[0][:1], passages=asks[0][1])  # warm both before timing
        local.complete(*asks[0][:1], passages=asks[0][1])
        times: dict[str, list[float]] = {"local": [], "remote": []}
        diffs: list[float] = []
        #: Per call, the time outside the engine: the wall time less the trace's total_s
        #: (admission to last token, measured where the model runs), so the two processes'
        #: decode speeds (other jobs, threads) do not enter the overhead.
        outside: dict[str, list[float]] = {"local": [], "remote": []}
        same, n_tokens = True, []
        for r in range(args.rounds):
            for q, passages in asks:
                out, took = {}, {}
                order = ("local", "remote") if r % 2 == 0 else ("remote", "local")
                for name in order:
                    llm = local if name == "local" else remote
                    t0 = time.perf_counter()
                    out[name] = llm.complete(q, passages=passages)
                    took[name] = time.perf_counter() - t0
                    times[name].append(took[name])
                    outside[name].append(took[name] - out[name].raw["timings"]["total_s"])
                diffs.append(took["remote"] - took["local"])
                a, b = out["local"], out["remote"]
                n_tokens.append(len(a.raw["steps"]))
                sources = [(s["token_id"], s["source"]) for s in a.raw["steps"]]
                same &= a.text == b.text and sources == [
                    (s["token_id"], s["source"]) for s in b.raw["steps"]
                ]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    fig = {
        "questions": len(asks),
        "rounds": args.rounds,
        "max_new_tokens": args.max_new_tokens,
        "median_local_s": round(statistics.median(times["local"]), 4),
        "median_remote_s": round(statistics.median(times["remote"]), 4),
        "median_overhead_s": round(statistics.median(diffs), 4),
        "overhead_p25_p75_s": [round(x, 4) for x in statistics.quantiles(diffs, n=4)[::2]],
        "median_outside_engine_local_s": round(statistics.median(outside["local"]), 4),
        "median_outside_engine_remote_s": round(statistics.median(outside["remote"]), 4),
        "median_outside_engine_overhead_s": round(
            statistics.median(
                r - lo for r, lo in zip(outside["remote"], outside["local"], strict=True)
            ),
            4,
        ),
        "median_ratio": round(
            statistics.median(times["remote"]) / statistics.median(times["local"]), 3
        ),
        "same_answers_and_sources": same,
        "mean_answer_tokens": round(statistics.mean(n_tokens), 1),
    }
    print(json.dumps(fig, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(fig, indent=2) + "\n")


if __name__ == "__main__":
    main()
