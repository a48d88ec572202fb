"""``tokrag bench --throughput``: generated tokens per second with several queries decoded as
one batch, the arms interleaved."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .bench_arms import THROUGHPUT_ARMS, arm

__all__: list[str] = []


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
    alike. Returns ``{"rounds", "arms": {arm: {n: {"tokens_per_s", "per_round",
    "decode_tokens_per_s", "questions_per_s"}}}, "ratios": {"arm / rag": {n: {"median", "min",
    "max"}}}, "question_ratios": {"arm / rag": {n: ...}}}``: tokens/s over all rounds (total
    tokens / total seconds), each round's tokens/s, the decode loop's tokens/s, answered
    questions per second, and the per-round ratio to ``rag``'s (measured side by side), with
    its median and spread, of tokens/s and of questions/s. The two ratios differ where the
    arms' answers differ in length: tokens/s counts a shorter answer as less work done, and
    questions/s counts every answer as one.
    """
    from tqdm.auto import tqdm

    from .batching import generate_batch

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
                "questions_per_s": n * len(v) / sum(d for _, d in v),
            }
            for n, v in per.items()
        }
    if "rag" in raw:
        out["question_ratios"] = {}
        for name in arms:
            if name == "rag":
                continue
            by_tokens, by_questions = {}, {}
            for n in sizes:
                pairs = list(zip(raw[name][n], raw["rag"][n], strict=True))
                by_tokens[str(n)] = _spread([(t / d) / (tr / dr) for (t, d), (tr, dr) in pairs])
                # The same n questions in both arms: the ratio of questions/s is rag's seconds
                # over this arm's.
                by_questions[str(n)] = _spread([dr / d for (_, d), (_, dr) in pairs])
            out["ratios"][f"{name} / rag"] = by_tokens
            out["question_ratios"][f"{name} / rag"] = by_questions
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}
