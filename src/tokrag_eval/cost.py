"""Cost (paper Table 6, docs/algorithm.md "Cost"): ``tokrag bench`` and ``tokrag eval cost``.

Side by side in one run, on the same questions: ``rag`` (one context), ``rag-kernels-off``
(the same decoder on a copy of the model without the package's CPU kernels), ``hf-generate``
and ``hf-generate-static`` (the stock baseline: Hugging Face ``model.generate``, greedy, on
that copy, fed the RAG prompt's ids with the same ``max_new_tokens`` and stops; the dynamic
cache, and the static cache with the decode step compiled as transformers does it for
``generate``), ``floor`` (both contexts decoded together, no signals), ``tokrag-step`` (one
forward pass per context: the reference every fast path must equal) and ``tokrag`` (the
default decoder); any other policy name or spec (``tokrag[lens_norm=false]``) is its own arm,
and ``ARM@PRESET`` runs an arm with a ``speed=`` preset (``tokrag@cuda``). Reported: wall
time per question, time per generated token, prefill and decode time, peak memory, the
agreement counts, whether ``tokrag`` gave exactly the tokens and decisions of ``tokrag-step``,
how many answers of the stock arms have ``rag``'s tokens, and the ratios; ``throughput`` adds
tokens/s and questions/s with several queries decoded as one batch (:func:`measure_throughput`).

Timing interleaves the arms question by question (their order rotated) so that drift in
machine load affects all of them alike. Peak memory is measured in a fresh subprocess per arm:
on CPU the peak RSS while decoding (VmHWM reset after loading and a warm-up), on CUDA
``torch.cuda.max_memory_allocated``; both the total and the increment over the loaded model.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokrag_integrations import config
from tokrag_integrations.config import require_bool

from .data import load_items
from .hf_baseline import HFRun, hf_generate, rag_prompt_ids
from .specs import parse_spec

#: Arm name -> (policy, generate options). The stock arms (:data:`STOCK_ARMS`) run on a second
#: copy of the model loaded without the package's CPU kernels.
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "rag": ("rag", {}),
    "rag-kernels-off": ("rag", {}),
    "floor": ("floor", {}),
    "tokrag-step": ("tokrag", {"speed": "reference"}),
    "tokrag": ("tokrag", {}),
}
#: The Hugging Face ``model.generate`` arms (:func:`hf_generate`) and their KV cache.
HF_ARMS = {"hf-generate": "dynamic", "hf-generate-static": "static"}
STOCK_ARMS = frozenset({"rag-kernels-off", *HF_ARMS})
#: Former arm names and what replaced them (asking for one is an error saying so).
RENAMED_ARMS = {"rag-stock": "rag-kernels-off"}
DEFAULT_POLICIES = ("rag", "floor", "tokrag-step", "tokrag", "rag-kernels-off", "hf-generate")
#: Fast arms whose tokens and decisions must equal ``tokrag-step``'s.
EXACT_ARMS = ("tokrag",)
#: The file ``tokrag bench`` reads from ``$TOKRAG_DATA_DIR`` when no ``--data`` is given.
DATA_FILE = "squad_dev.jsonl"


def arm_name(name: str) -> str:
    """``name``, checked: a former arm name is an error naming its replacement."""
    if name in RENAMED_ARMS:
        raise ValueError(
            f"bench arm {name!r} is now called {RENAMED_ARMS[name]!r} (the package's rag without "
            "its CPU kernels); the stock Hugging Face baseline is 'hf-generate'"
        )
    return name


def arm(name: str) -> tuple[str, dict[str, Any]]:
    """``(policy, options)`` of an arm: a named arm (:data:`ARMS`), else a policy spec;
    ``ARM@PRESET`` adds ``speed=PRESET``. A Hugging Face arm (:data:`HF_ARMS`) is
    ``("rag", {})``: the policy whose tokens it gives."""
    name = arm_name(name)
    if name in ARMS:
        return ARMS[name]
    if "@" in name:
        base, preset = name.rsplit("@", 1)
        if base in HF_ARMS:
            raise ValueError(f"arm {name!r}: the Hugging Face arms take no speed preset")
        pol, opts = arm(base)
        return pol, {**opts, "speed": preset}
    if name in HF_ARMS:
        return "rag", {}
    spec = parse_spec(name)
    return spec.name, ({"policy_options": spec.options} if spec.options else {})


def data_path(data: str | Path | None) -> Path:
    """``data``, else ``$TOKRAG_DATA_DIR/squad_dev.jsonl``; an error naming the fix otherwise."""
    if data:
        return Path(data)
    folder = config.data_dir()
    if folder is not None and (folder / DATA_FILE).is_file():
        return folder / DATA_FILE
    raise FileNotFoundError(
        f"no benchmark questions: pass --data PATH (a SQuAD-format JSONL file such as "
        f"shared/data/{DATA_FILE} in a checkout), or put {DATA_FILE} in $TOKRAG_DATA_DIR."
    )


def bench_items(
    path: str | Path, n: int, n_passages: int = 5, seed: int = 0
) -> list[tuple[str, list[str]]]:
    """The first ``n`` questions with ``n_passages`` passages: the positive first, then hard
    negatives, shuffled with a fixed seed (so the answer's rank varies)."""
    out = []
    for it in load_items(path):
        ps = (it.positives[:1] + it.negatives)[:n_passages]
        if len(ps) < n_passages:
            continue
        random.Random(f"{seed}-{it.id}").shuffle(ps)
        out.append((it.question, ps))
        if len(out) >= n:
            break
    if not out:
        raise ValueError(f"no usable items in {path} (need {n_passages} passages each)")
    return out


def _load(model: str, device: str | None, name: str) -> Any:
    from tokrag_integrations.models import load_model

    return load_model(model, device=device, cpu_kernels="off" if name in STOCK_ARMS else None)


def _one(
    lm: Any, name: str, q: str, ps: list[str], max_new_tokens: int, extra: dict[str, Any]
) -> Any:
    """Arm ``name`` on one question: a ``GenerationResult``, or an :class:`HFRun` for a Hugging
    Face arm."""
    from tokrag_integrations.engine.scheduler import generate

    if name in HF_ARMS:
        stop = extra.get("stop")
        return hf_generate(
            lm, [q], [ps], max_new_tokens=max_new_tokens, cache=HF_ARMS[name], stop=stop
        )
    pol, opts = arm(name)
    return generate(lm, q, ps, policy=pol, max_new_tokens=max_new_tokens, **opts, **extra)


def _compiled(name: str) -> bool:
    """Whether arm ``name`` compiles (or captures) a step for each new batch size or cache
    length: ``hf-generate-static`` and the arms of ``speed="cuda"``."""
    return name == "hf-generate-static" or name.endswith("@cuda")


def _warm_up(
    model_of: Any,
    name: str,
    items: list[tuple[str, list[str]]],
    max_new_tokens: int,
    extra: dict[str, Any],
    n: int = 1,
) -> None:
    """One untimed decode of arm ``name`` (allocator, kernels: the first timed question is no
    outlier). A compiled arm (:func:`_compiled`) decodes its ``n`` longest questions as one
    batch with the full ``max_new_tokens``, so that later calls of that batch size fit the
    cache it compiled for (transformers keeps the longest static cache of a model's calls)."""
    lm = model_of(name)
    if not _compiled(name):
        q, ps = items[0]
        _one(lm, name, q, ps, 4, extra)
        return
    lengths = [
        len(p)
        for p in rag_prompt_ids(lm, [q for q, _ in items], [p for _, p in items], max_new_tokens)
    ]
    order = sorted(range(len(items)), key=lambda i: -lengths[i])
    batch = [items[order[i % len(order)]] for i in range(n)]
    queries, passages = [q for q, _ in batch], [ps for _, ps in batch]
    if name in HF_ARMS:
        hf_generate(
            lm,
            queries,
            passages,
            max_new_tokens=max_new_tokens,
            cache=HF_ARMS[name],
            stop=extra.get("stop"),
        )
        return
    from tokrag_integrations.engine.scheduler import generate_batch

    pol, opts = arm(name)
    generate_batch(
        lm, queries, passages, policy=pol, max_new_tokens=max_new_tokens, **opts, **extra
    )


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
    items: list[tuple[str, list[str]]] | None = None,
    stop: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return its figures (see the module docstring). ``items``
    (question, passages) replace the ``questions`` read from ``data``; ``stop`` goes to every
    decode (default: ``generate``'s)."""
    import torch

    from tokrag_integrations.engine.seam import speed_paths

    require_bool(memory, "memory")
    require_bool(progress, "progress")
    require_bool(latency, "latency")
    policies = tuple(arm_name(p) for p in policies)
    for name in policies:
        arm(name)  # an unknown arm fails before any model is loaded
    if items is None:
        items = bench_items(data_path(data), questions, passages)
    extra = {} if stop is None else {"stop": list(stop)}
    lm = _load(model, device, "")
    stock = _load(model, device, "rag-kernels-off") if STOCK_ARMS & set(policies) else None

    def model_of(name: str) -> Any:
        return stock if name in STOCK_ARMS else lm

    for name in policies:
        _warm_up(model_of, name, items, max_new_tokens, extra)
    rows, decisions, prompt_tokens, answers = _timed_runs(
        model_of, items if latency else [], policies, max_new_tokens, progress, extra
    )
    out: dict[str, Any] = {
        "model": lm.name,
        "device": str(lm.device),
        "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        "questions": len(items),
        "passages": passages,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": statistics.mean(prompt_tokens) if prompt_tokens else None,
        "torch_threads": torch.get_num_threads(),
        "policies": {pol: policy_figures(rs) for pol, rs in rows.items()},
    }
    out.update(paired_figures(rows, decisions, answers))
    if memory:
        child = dict(model=model, device=device, items=items[:memory_questions], extra=extra)
        for pol in policies:
            m = _measure_memory(policy=pol, max_new_tokens=max_new_tokens, **child)
            out["policies"][pol].update(
                peak_mb=m["peak_mb"], peak_over_model_mb=m["peak_mb"] - m["base_mb"]
            )
    out["paths"] = speed_paths(lm)
    if throughput:
        out["throughput"] = measure_throughput(
            model_of, items, throughput, max_new_tokens, policies, progress, rounds
        )
    return out


def _timed_runs(
    model_of: Any,
    items: list[tuple[str, list[str]]],
    policies: tuple[str, ...],
    max_new_tokens: int,
    progress: bool,
    extra: dict[str, Any],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[Any]], list[int], dict[str, list[Any]]]:
    """Every arm on every question, their order rotated per question: per arm its timed rows,
    its decisions and its answers' token ids, and the RAG prompt lengths."""
    from tqdm.auto import tqdm


    rows: dict[str, list[dict[str, Any]]] = {p: [] for p in policies} if items else {}
    decisions: dict[str, list[Any]] = {p: [] for p in policies} if items else {}
    answers: dict[str, list[Any]] = {p: [] for p in policies} if items else {}
    prompt_tokens = []
    bar = tqdm(total=len(items) * len(policies), desc="bench", disable=not progress)
    for i, (q, ps) in enumerate(items):
        for name in policies[i % len(policies) :] + policies[: i % len(policies)]:
            t0 = time.perf_counter()
            r = _one(model_of(name), name, q, ps, max_new_tokens, extra)
            dt = time.perf_counter() - t0
            if isinstance(r, HFRun):
                a = r.answers[0]
                rows[name].append(
                    {
                        "seconds": dt,
                        "tokens": len(a),
                        "disagreements": 0,
                        "signal_steps": 0,
                        "prefill_s": r.prefill_s,
                        "decode_s": r.seconds - r.prefill_s,
                    }
                )
                decisions[name].append(None)
                answers[name].append(a)
                bar.update(1)
                continue
            steps, timings = r.trace.steps, r.trace.timings
            rows[name].append(
                {
                    "seconds": dt,
                    "tokens": len(steps),
                    "disagreements": sum(1 for s in steps if s.disagreement),
                    "signal_steps": sum(1 for s in steps if "cos_ir" in s.signals),
                    # Charged the prefill it reused from another arm (shared-prefill store).
                    "prefill_s": timings.get("prefill_s", 0.0)
                    + timings.get("prefill_reused_s", 0.0),
                    "decode_s": timings.get("decode_s", 0.0),
                }
            )
            decisions[name].append(
                [(s.token_id, s.source, s.signals.get("benefit")) for s in steps]
            )
            answers[name].append(list(r.token_ids))
            if name == "rag":
                prompt_tokens.append(r.trace.prompt_tokens.get("rag", 0))
            bar.update(1)
    bar.close()
    return rows, decisions, prompt_tokens, answers


def policy_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one arm from its timed rows (one per question). The prefill is paid
    once per question, the decode once per token: an arm whose answers are shorter pays its
    prefill over fewer tokens (its ``s_per_token`` rises)."""
    sec = [r["seconds"] for r in rs]
    tok = [r["tokens"] for r in rs]
    return {
        "s_per_question": statistics.mean(sec),
        "s_per_token": sum(sec) / max(1, sum(tok)),
        "tokens_per_question": statistics.mean(tok),
        "agreement_rate": 1 - sum(r["disagreements"] for r in rs) / max(1, sum(tok)),
        "disagreements_per_question": statistics.mean(r["disagreements"] for r in rs),
        "signal_steps_per_question": statistics.mean(r["signal_steps"] for r in rs),
        "prefill_s_per_question": statistics.mean(r["prefill_s"] for r in rs),
        "decode_s_per_token": sum(r["decode_s"] for r in rs) / max(1, sum(tok)),
    }


def paired_figures(
    rows: dict[str, list[dict[str, Any]]],
    decisions: dict[str, list[Any]],
    answers: dict[str, list[Any]] | None = None,
) -> dict[str, Any]:
    """``paired``: per question, the ratio of two arms' time per token (median and quartiles:
    robust to a question that met a burst of load); ``identical_to_step``: how many answers
    of each fast arm equal ``tokrag-step``'s, token and decision; ``same_tokens_as_rag``: how
    many answers of each stock arm (:data:`STOCK_ARMS`) have ``rag``'s tokens."""
    out: dict[str, Any] = {}
    pairs = [("tokrag", "rag"), ("floor", "rag")]
    pairs += [("rag", s) for s in ("hf-generate", "hf-generate-static") if s in rows]
    for a, b in pairs:
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
    for name in EXACT_ARMS:
        if name in decisions and "tokrag-step" in decisions:
            same = [a == b for a, b in zip(decisions[name], decisions["tokrag-step"], strict=True)]
            out.setdefault("identical_to_step", {})[name] = {
                "questions": len(same),
                "identical": sum(same),
            }
    for name in sorted(STOCK_ARMS):
        if answers and name in answers and "rag" in answers:
            same = [a == b for a, b in zip(answers[name], answers["rag"], strict=True)]
            out.setdefault("same_tokens_as_rag", {})[name] = {
                "questions": len(same),
                "identical": sum(same),
            }
    return out


def _status_mb(field: str) -> float:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in MiB; NaN off Linux."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return float("nan")


def _memory_child(
    policy: str,
    model: str,
    device: str | None,
    items: list[Any],
    max_new_tokens: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One arm on ``items`` in this (fresh) process: ``base_mb`` after loading and a warm-up,
    and ``peak_mb`` while decoding."""
    import resource

    import torch

    from tokrag_integrations.engine.scheduler import generate

    policy = arm_name(policy)
    lm = _load(model, device, policy)
    if policy == "hf-generate-static":  # compiled before the mark, as for the timed runs
        _warm_up(lambda _: lm, policy, items, max_new_tokens, extra)
    cuda = lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        generate(lm, items[0][0], items[0][1], policy="no_rag", max_new_tokens=2)
        try:  # reset the peak-RSS mark (VmHWM) so loading the model does not count
            Path("/proc/self/clear_refs").write_text("5")
            reset = True
        except OSError:  # pragma: no cover - non-Linux or not permitted
            reset = False
        base = _status_mb("VmRSS")
    for q, ps in items:
        _one(lm, policy, q, ps, max_new_tokens, extra)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    elif reset:
        peak = _status_mb("VmHWM")
    else:  # pragma: no cover - includes the loading spike
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"policy": policy, "base_mb": base, "peak_mb": peak}


def _measure_memory(**child: Any) -> dict[str, float]:
    """:func:`_memory_child` with ``child`` as its arguments (JSON on stdin), in a fresh process."""
    res = subprocess.run(
        [sys.executable, "-m", __name__],
        input=json.dumps(child),
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if res.returncode != 0:
        raise RuntimeError(
            f"memory measurement for {child['policy']} failed:\n{res.stderr[-2000:]}"
        )
    return json.loads(res.stdout.strip().splitlines()[-1])


#: Arms timed by ``--throughput`` (those of the run's policies that are one of these, or one
#: of these with a ``@PRESET``): the stock baseline, one context, both contexts without
#: signals, the default decoder.
THROUGHPUT_ARMS = ("hf-generate", "hf-generate-static", "rag", "floor", "tokrag")


def measure_throughput(
    model_of: Any,
    items: list[tuple[str, list[str]]],
    sizes: tuple[int, ...],
    max_new_tokens: int,
    policies: tuple[str, ...],
    progress: bool,
    rounds: int = 3,
) -> dict[str, Any]:
    """Tokens per second with ``n`` queries decoded as one batch, per arm and size ``n``.

    Each round runs every size, and at each size every arm on the same ``n`` questions, in an
    order rotated from one size and round to the next. Returns ``{"rounds", "arms": {arm: {n:
    {"tokens_per_s", "per_round", "decode_tokens_per_s", "questions_per_s"}}}, "ratios":
    {"arm / rag": {n: {"median", "min", "max"}}}, "question_ratios": {...}}``: per round, the
    ratio to ``rag`` of tokens/s and of questions/s (tokens/s counts a shorter answer as less
    work done; questions/s counts every answer as one).
    """
    from tqdm.auto import tqdm

    from tokrag_integrations.engine.scheduler import generate_batch

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    policies = tuple(arm_name(p) for p in policies)
    arms = [p for p in policies if p.split("@")[0] in THROUGHPUT_ARMS] or list(policies)
    for name in arms:  # compiled arms: compiled for each batch size before the clock starts
        for n in sizes if _compiled(name) else ():
            _warm_up(model_of, name, items, max_new_tokens, {}, n)
    raw: dict[str, dict[int, list[tuple[int, float]]]] = {a: {n: [] for n in sizes} for a in arms}
    decode: dict[str, dict[int, list[float]]] = {a: {n: [] for n in sizes} for a in arms}
    bar = tqdm(total=rounds * len(arms) * len(sizes), desc="throughput", disable=not progress)
    turn = 0
    for r in range(rounds):
        for n in sizes:
            batch = [items[(r * n + i) % len(items)] for i in range(n)]
            for name in arms[turn % len(arms) :] + arms[: turn % len(arms)]:
                pol, opts = arm(name)
                t0 = time.perf_counter()
                if name in HF_ARMS:
                    h = hf_generate(
                        model_of(name),
                        [q for q, _ in batch],
                        [ps for _, ps in batch],
                        max_new_tokens=max_new_tokens,
                        cache=HF_ARMS[name],
                    )
                    raw[name][n].append((sum(map(len, h.answers)), time.perf_counter() - t0))
                    decode[name][n].append(h.seconds - h.prefill_s)
                    bar.update(1)
                    continue
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
            turn += 1
    bar.close()
    out: dict[str, Any] = {"rounds": rounds, "arms": {}, "ratios": {}}
    for name, per in raw.items():
        out["arms"][name] = {
            str(n): {
                "tokens_per_s": sum(t for t, _ in v) / sum(d for _, d in v),
                "per_round": [t / d for t, d in v],
                # The decode loop alone: with short answers the prefill dominates tokens/s.
                "decode_tokens_per_s": sum(t for t, _ in v) / sum(decode[name][n]),
                "questions_per_s": n * len(v) / sum(d for _, d in v),
            }
            for n, v in per.items()
        }
    if "rag" in raw:
        out["question_ratios"] = {}
        for name in arms:
            if name == "rag":
                continue
            pairs = {n: list(zip(raw[name][n], raw["rag"][n], strict=True)) for n in sizes}
            out["ratios"][f"{name} / rag"] = {
                str(n): _spread([(t / d) / (tr / dr) for (t, d), (tr, dr) in p])
                for n, p in pairs.items()
            }
            # The same n questions in both arms: the ratio of questions/s is rag's seconds over this arm's.
            out["question_ratios"][f"{name} / rag"] = {
                str(n): _spread([dr / d for (_, d), (_, dr) in p]) for n, p in pairs.items()
            }
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    print(json.dumps(_memory_child(**json.loads(sys.stdin.read()))))
