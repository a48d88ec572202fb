"""``tokrag bench``: Tok-RAG's cost next to standard RAG and the two-context floor.

docs/algorithm.md, "Cost" / paper Table 6: the unavoidable cost of step-by-step Tok-RAG is the second (pure)
context; the signals must add little on top of it. Issue 8 asks for Tok-RAG within 1.15x of
standard RAG. This measures, side by side in one run and on the same questions: ``rag`` (one
context), ``rag-stock`` (the same on transformers' stock CPU kernels), ``floor`` (both
contexts decoded together, no signals), ``tokrag-step`` (the step-by-step loop, one
forward pass per context: the reference) and
``tokrag`` (the default: for one query both contexts packed into one sequence, one pass of
two positions per step; several queries as one batch), with wall time per question, time per
generated token, peak memory, the counts (agreement rate, disagreement steps per answer),
whether the fast arms gave exactly the tokens and decisions of
``tokrag-step``, and the ratios.
``--throughput 1,4,16`` adds tokens/s and questions/s with that many queries decoded as one batch.

Timing interleaves the policies question by question (rotating their order) so that drift in
machine load affects all of them alike. Peak memory is measured in a fresh subprocess per
policy: on CPU the peak RSS while decoding (VmHWM reset after loading and a warm-up, so the
loading spike is excluded), on CUDA ``torch.cuda.max_memory_allocated``; both the total and
the increment over the loaded model are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .bench_arms import (  # noqa: F401 - re-exported: this was their module
    ARMS,
    DEFAULT_POLICIES,
    EXACT_ARMS,
    STOCK_ARMS,
    THROUGHPUT_ARMS,
    arm,
)
from .bench_memory import _reset_peak_rss, _rss_mb, _status_mb  # noqa: F401 - re-exported
from .bench_report import format_report, paired_figures, policy_figures
from .bench_throughput import _throughput
from .booleans import require_bool


def _load_stock(model: str, device: str | None) -> Any:
    """The model again, with transformers' stock kernels (for the ``rag-stock`` arm)."""
    from .models import load_model

    return load_model(model, device=device, cpu_kernels="off")


def default_data_path() -> Path | None:
    """``shared/data/squad_dev.jsonl`` next to the repository, when it is there."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "data" / "squad_dev.jsonl"
        if cand.exists():
            return cand
    return None


def load_items(
    path: str | Path, n: int, n_passages: int = 5, seed: int = 0
) -> list[tuple[str, list[str]]]:
    """Questions with ``n_passages`` passages: the positive first, then hard negatives,
    shuffled with a fixed seed (so the answer's rank varies)."""
    items = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            d = json.loads(line)
            ps = (d.get("positives") or [])[:1] + (d.get("negatives") or [])
            if len(ps) < n_passages:
                continue
            ps = ps[:n_passages]
            random.Random(f"{seed}-{d['id']}").shuffle(ps)
            items.append((d["question"], ps))
            if len(items) >= n:
                break
    if not items:
        raise ValueError(f"no usable items in {path} (need {n_passages} passages each)")
    return items


def _memory_child(args: argparse.Namespace) -> None:
    """Run one policy on a few questions and print peak memory as JSON (subprocess mode).

    On CPU the peak is VmHWM after a reset taken once the model is loaded and warmed up, so
    it measures decoding, not the (larger, policy-independent) loading spike.
    """
    import resource

    import torch

    from .api import generate
    from .models import load_model

    lm = (
        _load_stock(args.model, args.device)
        if args.policy in STOCK_ARMS
        else load_model(args.model, device=args.device)
    )
    items = load_items(args.data, args.memory_questions, args.passages)
    cuda = lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        generate(lm, items[0][0], items[0][1], policy="llm", max_new_tokens=2)  # warm-up
        reset = _reset_peak_rss()
        base = _rss_mb()
    pol, opts = arm(args.policy)
    for q, ps in items:
        generate(lm, q, ps, policy=pol, max_new_tokens=args.max_new_tokens, **opts)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    elif reset:
        peak = _status_mb("VmHWM")
    else:  # pragma: no cover - includes the loading spike
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"policy": args.policy, "base_mb": base, "peak_mb": peak}))


def run_bench(
    *,
    model: str = "default",
    data: str | Path | None = None,
    questions: int = 20,
    passages: int = 5,
    max_new_tokens: int = 64,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    device: str | None = None,
    memory: bool = True,
    memory_questions: int = 3,
    progress: bool = True,
    throughput: tuple[int, ...] = (),
    rounds: int = 3,
    latency: bool = True,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see module docstring)."""
    from .api import generate
    from .models import load_model

    require_bool(memory, "memory")
    require_bool(progress, "progress")
    data = data or default_data_path()
    if data is None:
        raise FileNotFoundError("squad_dev.jsonl not found: pass --data PATH")
    lm = load_model(model, device=device)
    stock = _load_stock(model, device) if STOCK_ARMS & set(policies) else None

    def model_of(name: str) -> Any:
        return stock if name in STOCK_ARMS else lm

    items = load_items(data, questions, passages)
    # Warm-up (allocator, kernels) so the first timed question is not an outlier.
    for name in policies:
        pol, opts = arm(name)
        generate(model_of(name), items[0][0], items[0][1], policy=pol, max_new_tokens=4, **opts)

    require_bool(latency, "latency")
    rows, decisions, prompt_tokens = _timed_runs(
        model_of, items if latency else [], policies, max_new_tokens, progress
    )
    out: dict[str, Any] = {
        "model": lm.name,
        "device": str(lm.device),
        "questions": len(items),
        "passages": passages,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": statistics.mean(prompt_tokens) if prompt_tokens else None,
        "torch_threads": __import__("torch").get_num_threads(),
        "policies": {pol: policy_figures(rs) for pol, rs in rows.items()},
    }
    out.update(paired_figures(rows, decisions))
    if memory:
        for pol in policies:
            m = _measure_memory(pol, model, data, passages, max_new_tokens, memory_questions, device)
            out["policies"][pol].update(
                peak_mb=m["peak_mb"], peak_over_model_mb=m["peak_mb"] - m["base_mb"]
            )
    from .accel.install import speed_paths

    out["paths"] = speed_paths(lm.model)
    if throughput:
        out["throughput"] = _throughput(
            model_of, items, throughput, max_new_tokens, policies, progress, rounds
        )
    return out


def _timed_runs(
    model_of: Any,
    items: list[tuple[str, list[str]]],
    policies: tuple[str, ...],
    max_new_tokens: int,
    progress: bool,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[Any]], list[int]]:
    """Every arm on every question, their order rotated per question: per arm its timed rows
    and its decisions, and the RAG prompt lengths."""
    from tqdm.auto import tqdm

    from .api import generate

    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies} if items else {}
    decisions: dict[str, list[Any]] = {p: [] for p in policies} if items else {}
    prompt_tokens = []
    bar = tqdm(total=len(items) * len(policies), desc="bench", disable=not progress)
    for i, (q, ps) in enumerate(items):
        order = list(policies[i % len(policies) :] + policies[: i % len(policies)])
        for name in order:
            pol, opts = arm(name)
            t0 = time.perf_counter()
            r = generate(model_of(name), q, ps, policy=pol, max_new_tokens=max_new_tokens, **opts)
            dt = time.perf_counter() - t0
            steps = r.trace.steps
            rows[name].append(
                {
                    "seconds": dt,
                    "tokens": len(steps),
                    "disagreements": sum(1 for s in steps if s.disagreement),
                    "signal_steps": sum(1 for s in steps if "cos_ir" in s.signals),
                    # Charged the prefill it reused from another arm (shared-prefill store).
                    "prefill_s": r.trace.timings.get("prefill_s", 0.0) + r.trace.timings.get("prefill_reused_s", 0.0),
                    "decode_s": r.trace.timings.get("decode_s", 0.0),
                }
            )
            decisions[name].append(
                [(s.token_id, s.source, s.signals.get("benefit")) for s in steps]
            )
            if name == "rag":
                prompt_tokens.append(r.trace.prompt_tokens.get("rag", 0))
            bar.update(1)
    bar.close()
    return rows, decisions, prompt_tokens


def _measure_memory(
    pol: str,
    model: str,
    data: Any,
    passages: int,
    max_new_tokens: int,
    memory_questions: int,
    device: str | None,
) -> dict[str, float]:
    """``base_mb`` and ``peak_mb`` of arm ``pol``, measured in a fresh subprocess."""
    cmd = [
        sys.executable,
        "-m",
        "tokrag_integrations.bench",
        "--memory-child",
        pol,
        "--model",
        str(model),
        "--data",
        str(data),
        "--passages",
        str(passages),
        "--max-new-tokens",
        str(max_new_tokens),
        "--memory-questions",
        str(memory_questions),
    ]
    if device:
        cmd += ["--device", device]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if res.returncode != 0:
        raise RuntimeError(f"memory measurement for {pol} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def add_parser(subparsers: Any) -> None:
    """Register ``tokrag bench``."""
    p = subparsers.add_parser(
        "bench",
        help="time rag vs the two-context floor vs tokrag, step by step and fast (paper Table 6)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(p)
    p.set_defaults(func=_cmd)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument(
        "--data", default=None, help="SQuAD-format JSONL (default: shared/data/squad_dev.jsonl)"
    )
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--device", default=None)
    p.add_argument(
        "--no-memory", action="store_true", help="skip the per-policy memory subprocesses"
    )
    p.add_argument("--memory-questions", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument(
        "--throughput", default="", help="comma list of batch sizes for tokens/s and questions/s, e.g. 1,4,16"
    )
    p.add_argument(
        "--throughput-only",
        action="store_true",
        help="only the --throughput measurement (no per-question timing, no memory)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the interleaved --throughput measurement (default 3)",
    )


def _sizes(text: str) -> tuple[int, ...]:
    """``--throughput``'s batch sizes: a comma list of positive ints."""
    try:
        sizes = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise SystemExit(f"--throughput must be a comma list of batch sizes, e.g. 1,4,16; got {text!r}") from None
    if any(n < 1 for n in sizes):
        raise SystemExit(f"--throughput batch sizes must be >= 1, got {text!r}")
    return sizes


def _cmd(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    if args.throughput_only and not _sizes(args.throughput):
        raise SystemExit("--throughput-only needs --throughput SIZES, e.g. --throughput 1,4,16")
    res = run_bench(
        model=args.model,
        data=args.data,
        questions=args.questions,
        passages=args.passages,
        max_new_tokens=args.max_new_tokens,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        device=args.device,
        memory=not (args.no_memory or args.throughput_only),
        latency=not args.throughput_only,
        memory_questions=args.memory_questions,
        throughput=_sizes(args.throughput),
        rounds=args.rounds,
    )
    print(format_report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2), encoding="utf-8")
    return 0


def _main() -> None:
    p = argparse.ArgumentParser(prog="python -m tokrag_integrations.bench")
    _add_args(p)
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--policy", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.memory_child:
        args.policy = args.memory_child
        if args.data is None:
            args.data = default_data_path()
        _memory_child(args)
    else:
        sys.exit(_cmd(args))


if __name__ == "__main__":
    _main()
