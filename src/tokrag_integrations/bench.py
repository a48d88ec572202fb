"""``tokrag bench``: Tok-RAG's cost next to standard RAG and the two-context floor.

Spec §6 / paper Table 6: the unavoidable cost of Tok-RAG is the second (pure) context; the
signals must add little on top of it. This measures, side by side in one run and on the same
questions: ``rag`` (one context), ``floor`` (both contexts decoded, no signals) and ``tokrag``,
with wall time per question, time per generated token, peak memory, and their ratios.

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

DEFAULT_POLICIES = ("rag", "floor", "tokrag")


def default_data_path() -> Path | None:
    """``shared/data/squad_dev.jsonl`` next to the repository, when it is there."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "data" / "squad_dev.jsonl"
        if cand.exists():
            return cand
    return None


def load_items(path: str | Path, n: int, n_passages: int = 5, seed: int = 0) -> list[tuple[str, list[str]]]:
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


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return float("nan")


def _status_mb(field: str) -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return float("nan")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so loading the model does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:  # pragma: no cover - non-Linux or not permitted
        return False


def _memory_child(args: argparse.Namespace) -> None:
    """Run one policy on a few questions and print peak memory as JSON (subprocess mode).

    On CPU the peak is VmHWM after a reset taken once the model is loaded and warmed up, so
    it measures decoding, not the (larger, policy-independent) loading spike.
    """
    import resource

    import torch

    from .api import generate
    from .models import load_model

    lm = load_model(args.model, device=args.device)
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
    for q, ps in items:
        generate(lm, q, ps, policy=args.policy, max_new_tokens=args.max_new_tokens)
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
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see module docstring)."""
    from tqdm.auto import tqdm

    from .api import generate
    from .models import load_model

    data = data or default_data_path()
    if data is None:
        raise FileNotFoundError("squad_dev.jsonl not found: pass --data PATH")
    lm = load_model(model, device=device)
    items = load_items(data, questions, passages)
    # Warm-up (allocator, kernels) so the first timed question is not an outlier.
    for pol in policies:
        generate(lm, items[0][0], items[0][1], policy=pol, max_new_tokens=4)

    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    prompt_tokens = []
    bar = tqdm(total=len(items) * len(policies), desc="bench", disable=not progress)
    for i, (q, ps) in enumerate(items):
        order = list(policies[i % len(policies) :] + policies[: i % len(policies)])
        for pol in order:
            t0 = time.perf_counter()
            r = generate(lm, q, ps, policy=pol, max_new_tokens=max_new_tokens)
            dt = time.perf_counter() - t0
            steps = r.trace.steps
            rows[pol].append(
                {
                    "seconds": dt,
                    "tokens": len(r.token_ids) + (1 if r.stop_reason == "eos" else 0),
                    "disagreements": sum(1 for s in steps if s.disagreement),
                    "signal_steps": sum(1 for s in steps if "cos_ir" in s.signals),
                }
            )
            if pol == "rag":
                prompt_tokens.append(r.trace.prompt_tokens.get("rag", 0))
            bar.update(1)
    bar.close()

    out: dict[str, Any] = {
        "model": lm.name,
        "device": str(lm.device),
        "questions": len(items),
        "passages": passages,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": statistics.mean(prompt_tokens) if prompt_tokens else None,
        "torch_threads": __import__("torch").get_num_threads(),
        "policies": {},
    }
    for pol, rs in rows.items():
        sec = [r["seconds"] for r in rs]
        tok = [r["tokens"] for r in rs]
        out["policies"][pol] = {
            "s_per_question": statistics.mean(sec),
            "s_per_token": sum(sec) / max(1, sum(tok)),
            "tokens_per_question": statistics.mean(tok),
            "disagreements_per_question": statistics.mean(r["disagreements"] for r in rs),
            "signal_steps_per_question": statistics.mean(r["signal_steps"] for r in rs),
        }
    if memory:
        for pol in policies:
            cmd = [
                sys.executable, "-m", "tokrag_integrations.bench", "--memory-child", pol,
                "--model", str(model), "--data", str(data), "--passages", str(passages),
                "--max-new-tokens", str(max_new_tokens), "--memory-questions", str(memory_questions),
            ]
            if device:
                cmd += ["--device", device]
            res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if res.returncode != 0:
                raise RuntimeError(f"memory measurement for {pol} failed:\n{res.stderr[-2000:]}")
            m = json.loads(res.stdout.strip().splitlines()[-1])
            out["policies"][pol].update(peak_mb=m["peak_mb"], peak_over_model_mb=m["peak_mb"] - m["base_mb"])
    return out


def format_report(res: dict[str, Any]) -> str:
    """A Markdown table with the ratios the issue asks for."""
    P = res["policies"]
    lines = [
        f"model {res['model']} on {res['device']} ({res['torch_threads']} threads), "
        f"{res['questions']} SQuAD dev questions, {res['passages']} passages "
        f"(mean RAG prompt {res['mean_prompt_tokens']:.0f} tokens), max_new_tokens {res['max_new_tokens']}",
        "",
        "| policy | s / question | ms / token | tokens / question | disagreement steps / question | peak MB | peak over model MB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pol, p in P.items():
        lines.append(
            f"| {pol} | {p['s_per_question']:.3f} | {1000 * p['s_per_token']:.1f} | {p['tokens_per_question']:.1f} | "
            f"{p['disagreements_per_question']:.1f} | {p.get('peak_mb', float('nan')):.0f} | "
            f"{p.get('peak_over_model_mb', float('nan')):.0f} |"
        )
    lines.append("")

    def ratio(a: str, b: str, key: str) -> str:
        if a in P and b in P and key in P[a] and key in P[b]:
            return f"{P[a][key] / P[b][key]:.3f}"
        return "n/a"

    lines += [
        "| ratio | per question | per token | peak memory | peak over model |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a, b in (("tokrag", "floor"), ("tokrag", "rag"), ("floor", "rag")):
        lines.append(
            f"| {a} / {b} | {ratio(a, b, 's_per_question')} | {ratio(a, b, 's_per_token')} | "
            f"{ratio(a, b, 'peak_mb')} | {ratio(a, b, 'peak_over_model_mb')} |"
        )
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Register ``tokrag bench``."""
    p = subparsers.add_parser(
        "bench",
        help="time rag vs the two-context floor vs tokrag (spec §6, Table 6)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_args(p)
    p.set_defaults(func=_cmd)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--data", default=None, help="SQuAD-format JSONL (default: shared/data/squad_dev.jsonl)")
    p.add_argument("--questions", type=int, default=20)
    p.add_argument("--passages", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    p.add_argument("--device", default=None)
    p.add_argument("--no-memory", action="store_true", help="skip the per-policy memory subprocesses")
    p.add_argument("--memory-questions", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _cmd(args: argparse.Namespace) -> int:
    res = run_bench(
        model=args.model,
        data=args.data,
        questions=args.questions,
        passages=args.passages,
        max_new_tokens=args.max_new_tokens,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        device=args.device,
        memory=not args.no_memory,
        memory_questions=args.memory_questions,
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
