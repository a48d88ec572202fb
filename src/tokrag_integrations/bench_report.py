"""The figures of ``tokrag bench`` from its timed runs, and the Markdown report of them."""

from __future__ import annotations

import statistics
from typing import Any

from .bench_arms import EXACT_ARMS

__all__ = ["format_report", "paired_figures", "policy_figures"]


def policy_figures(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one arm from its timed rows (one per question)."""
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
    if all("prefill_s" in r and "decode_s" in r for r in rs):
        # The prefill is paid once per question, the decode once per token: an arm whose
        # answers are shorter pays its prefill over fewer tokens (s_per_token rises).
        d["prefill_s_per_question"] = statistics.mean(r["prefill_s"] for r in rs)
        d["decode_s_per_token"] = sum(r["decode_s"] for r in rs) / max(1, sum(tok))
    return d


def paired_figures(
    rows: dict[str, list[dict[str, Any]]], decisions: dict[str, list[Any]]
) -> dict[str, Any]:
    """``paired``: per question, both arms timed side by side, the ratio of their time per
    token with its median and quartiles (robust to a question that met a burst of load on a
    shared machine); ``identical_to_step``: how many answers of each fast arm equal
    ``tokrag-step``'s, token and decision."""
    out: dict[str, Any] = {}
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
        "| peak MB | peak over model MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    nan = float("nan")
    for pol, p in P.items():
        lines.append(
            f"| {pol} | {p['s_per_question']:.3f} | {1000 * p['s_per_token']:.1f} | {p['tokens_per_question']:.1f} | "
            f"{p['agreement_rate']:.3f} | {p['disagreements_per_question']:.1f} | "
            f"{p.get('peak_mb', nan):.0f} | {p.get('peak_over_model_mb', nan):.0f} |"
        )
    lines.append("")

    def ratio(a: str, b: str, key: str) -> str:
        if a in P and b in P and key in P[a] and key in P[b] and P[b][key]:
            return f"{P[a][key] / P[b][key]:.3f}"
        return "n/a"

    lines += [
        "| ratio | per question | per token | prefill per question | decode per token | peak memory | peak over model |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    pairs = (
        ("tokrag", "rag"),
        ("tokrag", "floor"),
        ("tokrag", "tokrag-step"),
        ("tokrag-step", "rag"),
        ("floor", "rag"),
        ("rag", "rag-stock"),
        ("tokrag", "rag-stock"),
    )
    for a, b in pairs:
        if a in P and b in P:
            lines.append(
                f"| {a} / {b} | {ratio(a, b, 's_per_question')} | {ratio(a, b, 's_per_token')} | "
                f"{ratio(a, b, 'prefill_s_per_question')} | {ratio(a, b, 'decode_s_per_token')} | "
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
    if res.get("throughput"):
        lines += _throughput_lines(res["throughput"])
    if res.get("paths"):
        lines += ["", "speed paths chosen on this machine:"]
        lines += [f"- {k}: {v}" for k, v in res["paths"].items()]
    return "\n".join(lines)


def _throughput_lines(tp: dict[str, Any]) -> list[str]:
    """The ``--throughput`` table: tokens/s per arm and batch size, and the ratios."""
    nan = float("nan")
    sizes = sorted({int(n) for v in tp["arms"].values() for n in v})
    lines = [
        "",
        f"tokens / s, queries decoded as one batch; arms interleaved, {tp['rounds']} round(s)",
        "",
        "| tokens / s | " + " | ".join(f"batch {n}" for n in sizes) + " |",
        "| --- |" + " --- |" * len(sizes),
    ]
    # One row per arm and measure: tokens/s, the decode loop's tokens/s, questions/s.
    for label, key, fmt in (
        ("", "tokens_per_s", ".1f"),
        (", decode loop only", "decode_tokens_per_s", ".1f"),
        (", questions / s", "questions_per_s", ".2f"),
    ):
        for name, v in tp["arms"].items():
            lines.append(
                f"| {name}{label} | "
                + " | ".join(format(v[str(n)].get(key, nan), fmt) if str(n) in v else "n/a" for n in sizes)
                + " |"
            )
    for label, key in (("", "ratios"), (" of questions / s", "question_ratios")):
        for name, v in (tp.get(key) or {}).items():
            lines.append(
                f"| {name}{label}, per round: median [min, max] | "
                + " | ".join(
                    f"{v[str(n)]['median']:.3f} [{v[str(n)]['min']:.2f}, {v[str(n)]['max']:.2f}]"
                    if str(n) in v
                    else "n/a"
                    for n in sizes
                )
                + " |"
            )
    return lines
