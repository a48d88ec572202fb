"""``tokrag bench``: Tok-RAG's cost next to standard RAG and the two-context floor.

docs/algorithm.md, "Cost" / paper Table 6: the unavoidable cost of step-by-step Tok-RAG is the second (pure)
context; the signals must add little on top of it. Issue 8 asks for Tok-RAG within 1.15x of
standard RAG. This measures, side by side in one run and on the same questions: ``rag`` (one
context), ``rag-stock`` (the same on transformers' stock CPU kernels), ``floor`` (both
contexts decoded together, no signals), ``tokrag-step`` (the step-by-step loop, one
forward pass per context: the reference), ``tokrag-blockwise`` (blockwise verification) and
``tokrag`` (the default: for one query both contexts packed into one sequence, one pass of
two positions per step; several queries as one batch), with wall time per question, time per
generated token, peak memory, the counts (agreement rate, disagreement steps per answer,
tokens per block), whether the fast arms gave exactly the tokens and decisions of
``tokrag-step``, and the ratios.
``--throughput 1,4,16`` adds tokens/s with that many queries decoded as one batch.

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

from .booleans import require_bool

#: Benchmark arms: name -> (policy, options). ``tokrag`` is the default decoder (the pure and
#: RAG contexts decoded together, step by step: packed into one sequence for one query); ``tokrag-step`` the step-by-step loop as
#: written (one forward pass per context), which every fast path must equal;
#: ``tokrag-blockwise`` blockwise verification (issue 8's idea). ``rag-stock`` is ``rag`` on
#: the same model with transformers' stock CPU kernels (``TOKRAG_CPU_KERNELS=off``).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "rag": ("rag", {}),
    "rag-stock": ("rag", {}),
    "floor": ("floor", {}),
    "tokrag-step": ("tokrag", {"speculative": False, "fuse": False}),
    "tokrag-blockwise": ("tokrag", {"speculative": True}),
    "tokrag": ("tokrag", {}),
    "llm": ("llm", {}),
}
#: Arms that run on a second copy of the model loaded with the stock kernels.
STOCK_ARMS = frozenset({"rag-stock"})
DEFAULT_POLICIES = ("rag", "floor", "tokrag-step", "tokrag-blockwise", "tokrag", "rag-stock")
SPEC_COUNTS = ("blocks", "drafted", "accepted", "verifier_wins", "stale")
#: Fast arms whose tokens and decisions must equal ``tokrag-step``'s.
EXACT_ARMS = ("tokrag", "tokrag-blockwise")


def _load_stock(model: str, device: str | None) -> Any:
    """The model again, with transformers' stock kernels (for the ``rag-stock`` arm)."""
    from .models import load_model

    return load_model(model, device=device, cpu_kernels="off")


def arm(name: str) -> tuple[str, dict[str, Any]]:
    """``(policy, options)`` of a benchmark arm; any policy name is its own arm."""
    return ARMS.get(name, (name, {}))


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
    from tqdm.auto import tqdm

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
    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies} if latency else {}
    decisions: dict[str, list[Any]] = {p: [] for p in policies} if latency else {}
    prompt_tokens = []
    bar = tqdm(total=len(items) * len(policies) * latency, desc="bench", disable=not progress)
    for i, (q, ps) in enumerate(items if latency else []):
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
                    **{k: r.trace.timings.get(k, 0.0) for k in SPEC_COUNTS},
                }
            )
            decisions[name].append(
                [(s.token_id, s.source, s.signals.get("benefit")) for s in steps]
            )
            if name == "rag":
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
        d = {
            "s_per_question": statistics.mean(sec),
            "s_per_token": sum(sec) / max(1, sum(tok)),
            "tokens_per_question": statistics.mean(tok),
            "agreement_rate": 1 - sum(r["disagreements"] for r in rs) / max(1, sum(tok)),
            "disagreements_per_question": statistics.mean(r["disagreements"] for r in rs),
            "signal_steps_per_question": statistics.mean(r["signal_steps"] for r in rs),
        }
        blocks = sum(r["blocks"] for r in rs)
        if blocks:
            drafted = sum(r["drafted"] for r in rs)
            d.update(
                blocks_per_question=blocks / len(rs),
                # Step 0 is read off the prefill; every other token comes out of a block.
                tokens_per_block=(sum(tok) - len(rs)) / blocks,
                draft_acceptance=sum(r["accepted"] for r in rs) / max(1, drafted),
                stale_per_question=sum(r["stale"] for r in rs) / len(rs),
            )
        out["policies"][pol] = d
    # Per question, both arms timed side by side: the ratio of their time per token, with its
    # median and quartiles (robust to a question that met a burst of load on a shared machine).
    for a, b in (("tokrag", "rag"), ("floor", "rag")):
        if a in rows and b in rows:
            rr = [
                (x["seconds"] / max(1, x["tokens"])) / (y["seconds"] / max(1, y["tokens"]))
                for x, y in zip(rows[a], rows[b], strict=True)
            ]
            qs = statistics.quantiles(rr, n=4) if len(rr) > 1 else [rr[0]] * 3
            out.setdefault("paired", {})[f"{a} / {b}"] = {
                "median": statistics.median(rr),
                "q1": qs[0],
                "q3": qs[2],
            }
    if "tokrag-step" in decisions:
        for name in EXACT_ARMS:
            if name in decisions:
                same = [
                    a == b for a, b in zip(decisions[name], decisions["tokrag-step"], strict=True)
                ]
                out.setdefault("identical_to_step", {})[name] = {
                    "questions": len(same),
                    "identical": sum(same),
                }
    if memory:
        for pol in policies:
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
            m = json.loads(res.stdout.strip().splitlines()[-1])
            out["policies"][pol].update(
                peak_mb=m["peak_mb"], peak_over_model_mb=m["peak_mb"] - m["base_mb"]
            )
    from .accel import speed_paths

    out["paths"] = speed_paths(lm.model)
    if throughput:
        out["throughput"] = _throughput(
            model_of, items, throughput, max_new_tokens, policies, progress, rounds
        )
    return out


#: Arms timed by ``--throughput`` (those of the run's ``--policies`` that are in it, in this
#: order): one context, both contexts without signals, the default decoder.
THROUGHPUT_ARMS = ("rag", "floor", "tokrag")


def _throughput(
    model_of: Any,
    items: list[tuple[str, list[str]]],
    sizes: tuple[int, ...],
    max_new_tokens: int,
    policies: tuple[str, ...],
    progress: bool,
    rounds: int = 3,
    latency: bool = True,
) -> dict[str, Any]:
    """Generated tokens per second with ``n`` queries decoded as one batch, per arm.

    The arms are interleaved: each round runs every batch size, and at each size every arm
    on the same ``n`` questions (the next ``n`` of ``items`` per round), in an order rotated
    from one size and round to the next, so that drift in machine load falls on all arms
    alike. Returns ``{"rounds", "arms": {arm: {n: {"tokens_per_s", "per_round"}}}, "ratios":
    {"arm / rag": {n: {"median", "min", "max"}}}}``: tokens/s over all rounds (total tokens
    / total seconds), each round's tokens/s, and the per-round ratio of tokens/s to ``rag``'s
    (measured side by side) with its median and spread.
    """
    from tqdm.auto import tqdm

    from .api import generate_batch

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    arms = [p for p in THROUGHPUT_ARMS if p in policies] or [p for p in policies]
    raw: dict[str, dict[int, list[tuple[int, float]]]] = {a: {n: [] for n in sizes} for a in arms}
    decode: dict[str, dict[int, list[float]]] = {a: {n: [] for n in sizes} for a in arms}
    bar = tqdm(total=rounds * len(arms) * len(sizes), desc="throughput", disable=not progress)
    turn = 0
    for r in range(rounds):
        for n in sizes:
            batch = [items[(r * n + i) % len(items)] for i in range(n)]
            order = arms[turn % len(arms) :] + arms[: turn % len(arms)]
            turn += 1
            for name in order:
                pol, opts = arm(name)
                t0 = time.perf_counter()
                rs = generate_batch(
                    model_of(name),
                    [q for q, _ in batch],
                    [ps for _, ps in batch],
                    policy=pol,
                    max_new_tokens=max_new_tokens,
                    **opts,
                )
                dt = time.perf_counter() - t0
                raw[name][n].append((sum(len(x.trace.steps) for x in rs), dt))
                timings = getattr(rs[0].trace, "timings", None) or {}
                decode[name][n].append(float(timings.get("decode_s", float("nan"))))
                bar.update(1)
    bar.close()
    out: dict[str, Any] = {"rounds": rounds, "arms": {}, "ratios": {}}
    for name, per in raw.items():
        out["arms"][name] = {
            str(n): {
                "tokens_per_s": sum(t for t, _ in v) / sum(d for _, d in v),
                "per_round": [t / d for t, d in v],
                # Tokens per second of the decode loop alone (prefill excluded): with short
                # answers the prefill dominates, and tokens/s then rewards long answers.
                "decode_tokens_per_s": sum(t for t, _ in v) / sum(decode[name][n]),
            }
            for n, v in per.items()
        }
    if "rag" in raw:
        for name in arms:
            if name == "rag":
                continue
            ratios = {}
            for n in sizes:
                rr = [
                    (t / d) / (tr / dr)
                    for (t, d), (tr, dr) in zip(raw[name][n], raw["rag"][n], strict=True)
                ]
                ratios[str(n)] = {
                    "median": statistics.median(rr),
                    "min": min(rr),
                    "max": max(rr),
                }
            out["ratios"][f"{name} / rag"] = ratios
    return out


def format_report(res: dict[str, Any]) -> str:
    """A Markdown table with the ratios the issue asks for."""
    P = res["policies"]
    lines = [
        f"model {res['model']} on {res['device']} ({res['torch_threads']} threads), "
        f"{res['questions']} SQuAD dev questions, {res['passages']} passages "
        + (
            f"(mean RAG prompt {res['mean_prompt_tokens']:.0f} tokens)"
            if res.get("mean_prompt_tokens") is not None
            else ""
        )
        + f", max_new_tokens {res['max_new_tokens']}",
        "",
        "| arm | s / question | ms / token | tokens / question | agreement rate | disagreement steps / question "
        "| tokens / block | draft acceptance | peak MB | peak over model MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    nan = float("nan")
    for pol, p in P.items():
        lines.append(
            f"| {pol} | {p['s_per_question']:.3f} | {1000 * p['s_per_token']:.1f} | {p['tokens_per_question']:.1f} | "
            f"{p['agreement_rate']:.3f} | {p['disagreements_per_question']:.1f} | "
            f"{p.get('tokens_per_block', nan):.2f} | {p.get('draft_acceptance', nan):.2f} | "
            f"{p.get('peak_mb', nan):.0f} | {p.get('peak_over_model_mb', nan):.0f} |"
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
    pairs = (
        ("tokrag", "rag"),
        ("tokrag", "floor"),
        ("tokrag", "tokrag-step"),
        ("tokrag-blockwise", "rag"),
        ("tokrag-blockwise", "tokrag-step"),
        ("tokrag-step", "rag"),
        ("floor", "rag"),
        ("rag", "rag-stock"),
        ("tokrag", "rag-stock"),
    )
    for a, b in pairs:
        if a in P and b in P:
            lines.append(
                f"| {a} / {b} | {ratio(a, b, 's_per_question')} | {ratio(a, b, 's_per_token')} | "
                f"{ratio(a, b, 'peak_mb')} | {ratio(a, b, 'peak_over_model_mb')} |"
            )
    for name, v in (res.get("paired") or {}).items():
        lines += [
            "",
            f"{name}, per token, per question (paired): median {v['median']:.3f} "
            f"[quartiles {v['q1']:.3f}, {v['q3']:.3f}]",
        ]
    for name, ident in (res.get("identical_to_step") or {}).items():
        lines += [
            "",
            f"{name} = tokrag-step, tokens and decisions: {ident['identical']} / {ident['questions']} questions",
        ]
    tp = res.get("throughput")
    if tp:
        sizes = sorted({int(n) for v in tp["arms"].values() for n in v})
        lines += [
            "",
            f"tokens / s, queries decoded as one batch; arms interleaved, {tp['rounds']} round(s)",
            "",
            "| tokens / s | " + " | ".join(f"batch {n}" for n in sizes) + " |",
            "| --- |" + " --- |" * len(sizes),
        ]
        for name, v in tp["arms"].items():
            lines.append(
                f"| {name} | "
                + " | ".join(f"{v[str(n)]['tokens_per_s']:.1f}" if str(n) in v else "n/a" for n in sizes)
                + " |"
            )
        for name, v in tp["arms"].items():
            lines.append(
                f"| {name}, decode loop only | "
                + " | ".join(
                    f"{v[str(n)].get('decode_tokens_per_s', nan):.1f}" if str(n) in v else "n/a"
                    for n in sizes
                )
                + " |"
            )
        for name, v in tp["ratios"].items():
            lines.append(
                f"| {name}, per round: median [min, max] | "
                + " | ".join(
                    f"{v[str(n)]['median']:.3f} [{v[str(n)]['min']:.2f}, {v[str(n)]['max']:.2f}]"
                    if str(n) in v
                    else "n/a"
                    for n in sizes
                )
                + " |"
            )
    if res.get("paths"):
        lines += ["", "speed paths chosen on this machine:"]
        lines += [f"- {k}: {v}" for k, v in res["paths"].items()]
    return "\n".join(lines)


def add_parser(subparsers: Any) -> None:
    """Register ``tokrag bench``."""
    p = subparsers.add_parser(
        "bench",
        help="time rag vs the two-context floor vs tokrag, step by step and blockwise (paper Table 6)",
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
        "--throughput", default="", help="comma list of batch sizes for tokens/s, e.g. 1,4,16"
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
