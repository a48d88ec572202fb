"""Load test of ``tokrag serve``: N concurrent clients for a fixed time, per policy and setup.

    python benchmarks/load_serve.py [--clients 1,4,16,64] [--duration 30] [--policies rag,tokrag]
        [--setups process,ray] [--max-tokens 24] [--stream] [--out benchmarks/results/load_serve.json]

Each setup is started as its own process through the real command line: ``process`` is
``tokrag serve`` (one model), ``process-batch`` the same with ``--no-continuous-batching``,
``process-budget`` with a prefill budget per step (``--max-prefill-tokens 2048``),
``ray`` is ``tokrag serve --ray --replicas 2`` (two replicas, one torch thread each). Each client sends one chat completion after another (the packaged sample
questions in turn, each with its BM25 top-3 passages from the sample documents as
``documents``, ``tokrag.policy`` set) and starts no new request after ``--duration`` seconds;
requests still running then are waited for and counted. Prints, per setup / policy / client
count: completed requests, errors (any non-200 answer or failed connection), p50 / p95
latency, generated tokens per second (completion tokens over the wall time from the first
request to the last answer), and the tokrag / rag throughput ratio. With ``--stream`` every
request is streamed (``"stream": true`` with the usage chunk) and the p50 / p95 time to the
first content chunk are printed too; ``process-batch`` is then the server where streams
decode alone (without continuous batching a stream never joins a decode). The servers' logs
go to ``out/load_serve.<setup>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(setup: str, port: int, max_tokens: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokrag_integrations.cli", "serve", "--port", str(port),
           "--max-new-tokens", str(max_tokens)]
    if setup == "ray":
        cmd += ["--ray", "--replicas", "2"]
    if setup == "process-batch":  # the micro-batcher without continuous batching
        cmd += ["--no-continuous-batching"]
    if setup == "process-budget":  # continuous, at most 2048 prompt tokens prefilled a step
        cmd += ["--max-prefill-tokens", "2048"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = log.open("w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {setup} server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the {setup} server did not become healthy; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def workload() -> list[tuple[str, list[str]]]:
    from tokrag_integrations.retrieval import (
        build_retriever,
        get_sample_docs_path,
        get_sample_questions,
    )

    ret = build_retriever(get_sample_docs_path(), "bm25")
    return [(q["question"], [h.text for h in ret.retrieve(q["question"], top_k=3)])
            for q in get_sample_questions()]


async def _streamed(http, body: dict) -> tuple[int, float | None]:
    """Send ``body`` as a stream; (completion tokens, seconds to the first content chunk)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(str(r.status_code))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - t
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first


async def run_load(url: str, items, policy: str, clients: int, duration: float,
                   max_tokens: int, stream: bool = False) -> dict:
    import httpx

    firsts: list[float] = []
    latencies: list[float] = []
    tokens = 0
    errors: list[str] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        start = time.perf_counter()
        stop_at = start + duration

        async def client(k: int) -> None:
            nonlocal tokens
            i = k
            while time.perf_counter() < stop_at:
                question, docs = items[i % len(items)]
                i += clients
                body = {"model": "default", "max_tokens": max_tokens, "documents": docs,
                        "messages": [{"role": "user", "content": question}],
                        "tokrag": {"policy": policy, "trace": False}}
                t = time.perf_counter()
                if stream:
                    try:
                        n, first = await _streamed(http, body)
                    except (httpx.HTTPError, RuntimeError) as exc:
                        errors.append(str(exc) if isinstance(exc, RuntimeError) else type(exc).__name__)
                        continue
                    latencies.append(time.perf_counter() - t)
                    tokens += n
                    if first is not None:
                        firsts.append(first)
                    continue
                try:
                    r = await http.post("/v1/chat/completions", json=body)
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)
                    continue
                if r.status_code != 200:
                    errors.append(str(r.status_code))
                    continue
                latencies.append(time.perf_counter() - t)
                tokens += r.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.perf_counter() - start
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=20) if len(lat) >= 2 else lat * 19
    return {"policy": policy, "clients": clients, "requests": len(lat), "errors": len(errors),
            "error_kinds": sorted(set(errors)), "wall_s": wall,
            "p50_s": statistics.median(lat) if lat else None,
            "p95_s": q[18] if lat else None, "tokens": tokens,
            "tokens_per_s": tokens / wall,
            **({"first_p50_s": statistics.median(firsts),
                "first_p95_s": (statistics.quantiles(firsts, n=20)[18] if len(firsts) >= 2 else firsts[0])}
               if firsts else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--policies", default="rag,tokrag")
    ap.add_argument("--setups", default="process,ray")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--stream", action="store_true", help="stream every request")
    ap.add_argument("--out", default="benchmarks/results/load_serve.json")
    args = ap.parse_args()
    items = workload()
    counts = [int(c) for c in args.clients.split(",")]
    policies = args.policies.split(",")
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for setup in args.setups.split(","):
        port = free_port()
        logs = Path("out")  # git-ignored
        logs.mkdir(exist_ok=True)
        proc = start_server(setup, port, args.max_tokens, logs / f"load_serve.{setup}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            for policy in policies:  # warm-up: one request per policy
                asyncio.run(run_load(url, items, policy, 1, 0.0, args.max_tokens, args.stream))
            for n in counts:
                for policy in policies:
                    row = asyncio.run(run_load(url, items, policy, n, args.duration,
                                               args.max_tokens, args.stream))
                    row["stream"] = args.stream
                    row["setup"] = setup
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    out.write_text(json.dumps(rows, indent=1))
        finally:
            stop_server(proc)
    print("\n| setup | clients | policy | requests | errors | p50 s | p95 s | first token p50 / p95 s | tokens/s | tokrag / rag |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["setup"], r["clients"], r["policy"]): r for r in rows}
    for r in rows:
        base = by.get((r["setup"], r["clients"], "rag"))
        ratio = (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
                 if r["policy"] == "tokrag" and base and base["tokens_per_s"] else "")
        p50 = f"{r['p50_s']:.1f}" if r["p50_s"] is not None else "-"
        p95 = f"{r['p95_s']:.1f}" if r["p95_s"] is not None else "-"
        first = (f"{r['first_p50_s']:.1f} / {r['first_p95_s']:.1f}" if "first_p50_s" in r else "-")
        print(f"| {r['setup']} | {r['clients']} | {r['policy']} | {r['requests']} | "
              f"{r['errors']} | {p50} | {p95} | {first} | {r['tokens_per_s']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
