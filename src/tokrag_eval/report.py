"""Summaries -> JSON, Markdown tables and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _ci(ci: Any, nd: int = 1) -> str:
    if not ci or any(v is None or math.isnan(v) for v in ci):
        return ""
    return f" [{ci[0]:.{nd}f}, {ci[1]:.{nd}f}]"


def _table(head: Sequence[Any], rows: Iterable[Sequence[Any]], sep: str = "|---") -> str:
    """A Markdown table; ``sep`` is each column's share of the separator line."""
    lines = ["| " + " | ".join(map(str, r)) + " |" for r in (head, *rows)]
    lines.insert(1, sep * len(head) + "|")
    return "\n".join(lines)


def _with_ci(x: Any, ci: Any) -> str:
    return _fmt(x) + (
        _ci(ci) if x is not None and not (isinstance(x, float) and math.isnan(x)) else ""
    )


def accuracy_table(summary: dict[str, Any], key: str = "accuracy", label: str = "policy") -> str:
    """Markdown table: rows = policies, columns = conditions, cells = ``summary[key]`` with
    the 95 % bootstrap interval where the summary has one (``41.3 [33.0, 49.7]``)."""
    conds = summary["conditions"]
    cis = summary.get(f"{key}_ci", {})
    rows = []
    for p in summary["policies"]:
        vals = [summary[key][p].get(c, math.nan) for c in conds]
        ok = [v for v in vals if not math.isnan(v)]
        mean = summary.get(f"{key}_mean", {}).get(p, sum(ok) / len(ok) if ok else math.nan)
        cells = [_with_ci(v, cis.get(p, {}).get(c)) for v, c in zip(vals, conds, strict=True)]
        rows.append([p, *cells, _with_ci(mean, summary.get(f"{key}_mean_ci", {}).get(p))])
    return _table([label, *conds, "mean"], rows)


def _verdict(ci: Any, baseline: str) -> str:
    if not ci or any(math.isnan(v) for v in ci):
        return "–"
    if ci[0] > 0:
        return f"above {baseline}"
    if ci[1] < 0:
        return f"below {baseline}"
    return f"not distinguishable from {baseline}"


def paired_table(summary: dict[str, Any]) -> str:
    """Markdown table: each policy − the baseline (``rag``) of the mean over conditions, with
    the paired bootstrap 95 % interval (same items resampled for both)."""
    base = summary.get("paired_baseline", "rag")
    paired = summary.get("paired", {})
    has_cf = any(
        not math.isnan(d.get("cf_repeat", {}).get("diff", math.nan)) for d in paired.values()
    )
    rows = []
    for p, d in paired.items():
        acc, cf = d["accuracy"], d.get("cf_repeat")
        row = [p, _fmt(acc["diff"]) + _ci(acc["ci"]), _verdict(acc["ci"], base)]
        rows.append(row + ([_fmt(cf["diff"]) + _ci(cf["ci"])] if has_cf else []))
    head = ["policy", f"accuracy − {base}", "95% interval says"]
    return _table(head + ([f"cf-repeat − {base}"] if has_cf else []), rows)


def passages_table(summary: dict[str, Any]) -> str:
    conds = summary["conditions"]
    mp = summary.get("mean_passages", {})
    rows = [
        [f"mean {kind} passages", *(_fmt(mp.get(c, {}).get(kind), 2) for c in conds)]
        for kind in ("pos", "neg", "cf")
        if any(mp.get(c, {}).get(kind) for c in conds)
    ]
    rows.append(["items lacking passages", *(summary["items_short"].get(c, 0) for c in conds)])
    return _table(["condition", *conds], rows)


def token_table(summary: dict[str, Any]) -> str:
    """Markdown table per scorer: AUC with its 95 % interval, F1, macro-F1 and label counts."""
    head = ["scorer", "AUC [95% CI]", "F1", "macro-F1", "samples", "label 1", "label 0"]
    rows = [
        [name, _fmt(s["auc"]) + _ci(s.get("auc_ci")), _fmt(s["f1"]), _fmt(s["macro_f1"])]
        + [s["n"], s.get("n_label1", "–"), s.get("n_label0", "–")]
        for name, s in summary["scorers"].items()
    ]
    return _table(head, rows)


def token_sources_table(summary: dict[str, Any]) -> str:
    """Markdown table: label counts and each scorer's AUC [95% CI] per source and pooled."""
    names = list(summary["scorers"])
    rows = []
    for src, s in [*summary.get("sources", {}).items(), ("pooled", summary)]:
        aucs = [s["scorers"].get(n) for n in names]
        cells = [_fmt(f["auc"]) + _ci(f.get("auc_ci")) if f else "–" for f in aucs]
        rows.append([src, s["n_label1"], s["n_label0"], *cells])
    return _table(["source", "label 1", "label 0", *names], rows)


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(
        json.dumps(data, indent=2, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8"
    )
    return p


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise ImportError("Plots need matplotlib: pip install 'tokrag-integrations[eval]'") from e
    return plt


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return p


def _errors(vals: list[float], cis: list[Any]) -> list[list[float]]:
    """Error bar lengths below and above each value from its [lo, hi] (0 where unknown)."""
    pairs = list(zip(vals, cis, strict=True))
    lo = [0 if math.isnan(v - c[0]) else max(v - c[0], 0) for v, c in pairs]
    return [lo, [0 if math.isnan(c[1] - v) else max(c[1] - v, 0) for v, c in pairs]]


def plot_accuracy(
    summary: dict[str, Any], path: str | Path, title: str = "", key: str = "accuracy"
) -> Path:
    """Accuracy vs condition (noise ratio) per policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    conds = summary["conditions"]
    x = list(range(len(conds)))
    cis = summary.get(f"{key}_ci", {})
    for p in summary["policies"]:
        ys = [summary[key][p].get(c, math.nan) for c in conds]
        style = {"linewidth": 2.6, "color": "black"} if p == "tokrag" else {"linewidth": 1.3}
        ci = [cis.get(p, {}).get(c) or [y, y] for c, y in zip(conds, ys, strict=True)]
        ax.errorbar(
            x, ys, yerr=_errors(ys, ci), marker="o", label=p, capsize=2, elinewidth=0.8, **style
        )
    ax.set_xticks(x, conds)
    ax.set_xlabel(
        "noise ratio" if key == "accuracy" and not conds[0].startswith("cf") else "condition"
    )
    ax.set_ylabel("cover EM (%)" if key == "accuracy" else "counterfactual repeat (%)")
    ax.set_title(title or f"n = {summary['n_items']} items")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return _save(plt, fig, path)


def plot_auc(summary: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """AUC bar per scorer (token level)."""
    plt = _plt()
    names = list(summary["scorers"])
    vals = [summary["scorers"][n]["auc"] for n in names]
    cis = [summary["scorers"][n].get("auc_ci") or [v, v] for n, v in zip(names, vals, strict=True)]
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    colors = ["#c44" if n in ("logprob", "entropy") else "#468" for n in names]
    ax.barh(names, vals, xerr=_errors(vals, cis), color=colors, capsize=2)
    ax.axvline(50, color="gray", linestyle="--", linewidth=1)
    for i, v in enumerate(vals):
        if not math.isnan(v):
            ax.text(v + 0.5, i, f"{v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("AUC (%)")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_title(
        title or f"token level: {summary['n_samples']} samples ({summary['n_benefit']} benefit)",
        fontsize=9,
    )
    return _save(plt, fig, path)


def _section(text: str, table: str) -> list[str]:
    return [text, "", table, ""]


def _write(
    summary: dict[str, Any], out: Path, name: str, title: str, command: str, md: list[str]
) -> list[Path]:
    """``<name>.json`` (the summary and ``command``) and ``<name>.md`` (title, command, ``md``)."""
    files = [write_json(out / f"{name}.json", {**summary, "command": command}), out / f"{name}.md"]
    head = [f"## {title}", ""] + (["```", command, "```", ""] if command else [])
    files[1].write_text("\n".join(head + md), encoding="utf-8")
    return files


def write_accuracy_report(
    summary: dict[str, Any], out_dir: str | Path, name: str, title: str, command: str = ""
) -> list[Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` (+ ``<name>_cf_repeat.png``) in out_dir."""
    out = Path(out_dir)
    md = _section(
        "Accuracy (cover EM, %; [95% bootstrap interval over items]):", accuracy_table(summary)
    )
    # Repeat rates only mean something where counterfactual passages were given.
    has_cf = any(
        summary.get("mean_passages", {}).get(c, {}).get("cf") for c in summary["conditions"]
    )
    if has_cf:
        md += _section(
            "Answers repeating the counterfactual answer (%):", accuracy_table(summary, "cf_repeat")
        )
    if summary.get("paired"):
        md += _section(
            f"Paired differences to {summary.get('paired_baseline', 'rag')} (mean over conditions, "
            "percentage points, 95% bootstrap interval over items):",
            paired_table(summary),
        )
    if summary.get("verdict_rate"):
        md += _section(
            f"Yes/no items ({summary['n_yes_no_items']}): answers stating a verdict (a standalone yes or no, %):",
            accuracy_table(summary, "verdict_rate"),
        )
        md += _section(
            "Accuracy among the answers that state a verdict (%):",
            accuracy_table(summary, "verdict_accuracy"),
        )
    if summary.get("mean_tokens"):
        line = "Mean answer length (tokens): " + ", ".join(
            f"{p} {_fmt(summary['mean_tokens'][p])}" for p in summary["policies"]
        )
        if summary.get("length_ratio"):
            base = summary.get("paired_baseline", "rag")
            line += f"; against {base} on the same answers: " + ", ".join(
                f"{p} {_fmt(r, 2)}x" for p, r in summary["length_ratio"].items()
            )
        md += [line, ""]
    md += _section("Passages given:", passages_table(summary))
    secs = (f"{p} {_fmt(summary['mean_time_s'][p], 2)}" for p in summary["policies"])
    md += ["Mean seconds per question: " + ", ".join(secs), ""]
    files = _write(summary, out, name, title, command, md)
    files.append(plot_accuracy(summary, out / f"{name}.png", f"{title} (n = {summary['n_items']})"))
    if has_cf:
        cf_title = title + " (counterfactual repeats)"
        files.append(
            plot_accuracy(summary, out / f"{name}_cf_repeat.png", cf_title, key="cf_repeat")
        )
    return files


def write_token_report(
    summary: dict[str, Any], out_dir: str | Path, name: str, title: str, command: str = ""
) -> list[Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` (AUC per scorer) in out_dir."""
    n, n1 = summary["n_samples"], summary["n_benefit"]
    md = _section(
        f"{n} labelled positions: {n1} label 1 (only RAG predicts the gold token), {n - n1} "
        "label 0 (only the pure LLM does). AUC in %, 95% bootstrap interval over items.",
        token_table(summary),
    )
    if summary.get("sources"):
        md += _section(
            "Per source (AUC [95% CI]; pooled = all samples):", token_sources_table(summary)
        )
    files = _write(summary, Path(out_dir), name, title, command, md)
    return [*files, plot_auc(summary, Path(out_dir) / f"{name}.png", title)]


def bench_table(res: dict[str, Any]) -> str:
    """The Markdown report of ``tokrag bench`` (:func:`.cost.run_bench`): per arm, the ratios,
    the paired ratios, exactness, throughput and the speed paths chosen."""
    P = res["policies"]
    prompt = res.get("mean_prompt_tokens")
    nan = float("nan")
    arms = [
        [pol, f"{p['s_per_question']:.3f}", f"{1000 * p['s_per_token']:.1f}"]
        + [f"{p['tokens_per_question']:.1f}", f"{p['agreement_rate']:.3f}"]
        + [f"{p['disagreements_per_question']:.1f}", f"{p.get('peak_mb', nan):.0f}"]
        + [f"{p.get('peak_over_model_mb', nan):.0f}"]
        for pol, p in P.items()
    ]
    keys = ("s_per_question", "s_per_token", "prefill_s_per_question", "decode_s_per_token")
    keys += ("peak_mb", "peak_over_model_mb")
    pairs = [("tokrag", "rag"), ("tokrag", "floor"), ("tokrag", "tokrag-step")]
    pairs += [
        ("tokrag-step", "rag"),
        ("floor", "rag"),
        ("rag", "rag-kernels-off"),
        ("rag", "hf-generate"),
        ("rag", "hf-generate-static"),
        ("tokrag", "hf-generate"),
        ("tokrag", "hf-generate-static"),
    ]
    ratios = [
        [f"{a} / {b}"]
        + [f"{P[a][k] / P[b][k]:.3f}" if k in P[a] and P[b].get(k) else "n/a" for k in keys]
        for a, b in pairs
        if a in P and b in P
    ]
    lines = [
        f"model {res['model']} on {res['device']}"
        + (f" in {res['dtype']}" if res.get("dtype") else "")
        + f" ({res['torch_threads']} threads), "
        f"{res['questions']} questions, {res['passages']} passages "
        + (f"(mean RAG prompt {prompt:.0f} tokens)" if prompt is not None else "")
        + f", max_new_tokens {res['max_new_tokens']}",
        "",
        _table(
            ["arm", "s / question", "ms / token", "tokens / question", "agreement rate"]
            + ["disagreement steps / question", "peak MB", "peak over model MB"],
            arms,
            sep="| --- ",
        ),
        "",
        _table(
            ["ratio", "per question", "per token", "prefill per question", "decode per token"]
            + ["peak memory", "peak over model"],
            ratios,
            sep="| --- ",
        ),
    ]
    for name, v in (res.get("paired") or {}).items():
        lines += [
            "",
            f"{name}, per token, per question (paired): median {v['median']:.3f} "
            f"[quartiles {v['q1']:.3f}, {v['q3']:.3f}]",
        ]
    for name, ident in (res.get("identical_to_step") or {}).items():
        same = f"{ident['identical']} / {ident['questions']} questions"
        lines += ["", f"{name} = tokrag-step, tokens and decisions: {same}"]
    for name, ident in (res.get("same_tokens_as_rag") or {}).items():
        same = f"{ident['identical']} / {ident['questions']} questions"
        lines += ["", f"{name} = rag, tokens: {same}"]
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
    rows = []
    for label, key, fmt in (
        ("", "tokens_per_s", ".1f"),
        (", decode loop only", "decode_tokens_per_s", ".1f"),
        (", questions / s", "questions_per_s", ".2f"),
    ):
        for name, v in tp["arms"].items():
            cells = [format(v[str(n)].get(key, nan), fmt) if str(n) in v else "n/a" for n in sizes]
            rows.append([f"{name}{label}", *cells])
    for label, key in (("", "ratios"), (" of questions / s", "question_ratios")):
        for name, v in (tp.get(key) or {}).items():
            spread = [v.get(str(n)) for n in sizes]
            cells = [
                f"{r['median']:.3f} [{r['min']:.2f}, {r['max']:.2f}]" if r else "n/a"
                for r in spread
            ]
            rows.append([f"{name}{label}, per round: median [min, max]", *cells])
    return [
        "",
        f"tokens / s, queries decoded as one batch; arms interleaved, {tp['rounds']} round(s)",
        "",
        _table(["tokens / s", *(f"batch {n}" for n in sizes)], rows, sep="| --- "),
    ]
