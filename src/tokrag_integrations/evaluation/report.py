"""Summaries -> JSON, Markdown tables and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def accuracy_table(summary: dict[str, Any], key: str = "accuracy", label: str = "policy") -> str:
    """Markdown table: rows = policies, columns = conditions, cells = ``summary[key]``."""
    conds = summary["conditions"]
    lines = [f"| {label} | " + " | ".join(conds) + " | mean |", "|---" * (len(conds) + 2) + "|"]
    for p in summary["policies"]:
        vals = [summary[key][p].get(c, math.nan) for c in conds]
        ok = [v for v in vals if not math.isnan(v)]
        mean = sum(ok) / len(ok) if ok else math.nan
        lines.append(f"| {p} | " + " | ".join(_fmt(v) for v in vals) + f" | {_fmt(mean)} |")
    return "\n".join(lines)


def passages_table(summary: dict[str, Any]) -> str:
    conds = summary["conditions"]
    lines = ["| condition | " + " | ".join(conds) + " |", "|---" * (len(conds) + 1) + "|"]
    mp = summary.get("mean_passages", {})
    for kind in ("pos", "neg", "cf"):
        if any(mp.get(c, {}).get(kind) for c in conds):
            lines.append(f"| mean {kind} passages | " + " | ".join(_fmt(mp.get(c, {}).get(kind), 2) for c in conds) + " |")
    lines.append("| items lacking passages | " + " | ".join(str(summary["items_short"].get(c, 0)) for c in conds) + " |")
    return "\n".join(lines)


def token_table(summary: dict[str, Any]) -> str:
    lines = ["| scorer | AUC | F1 | macro-F1 | samples |", "|---|---|---|---|---|"]
    for name, s in summary["scorers"].items():
        lines.append(f"| {name} | {_fmt(s['auc'])} | {_fmt(s['f1'])} | {_fmt(s['macro_f1'])} | {s['n']} |")
    return "\n".join(lines)


def write_json(path: str | Path, data: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=True) + "\n", encoding="utf-8")
    return p


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover
        raise ImportError("Plots need matplotlib: pip install 'tokrag-integrations[eval]'") from e
    return plt


def plot_accuracy(summary: dict[str, Any], path: str | Path, title: str = "", key: str = "accuracy") -> Path:
    """Accuracy vs condition (noise ratio) per policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    conds = summary["conditions"]
    x = list(range(len(conds)))
    for p in summary["policies"]:
        ys = [summary[key][p].get(c, math.nan) for c in conds]
        style = {"linewidth": 2.6, "color": "black"} if p == "tokrag" else {"linewidth": 1.3}
        ax.plot(x, ys, marker="o", label=p, **style)
    ax.set_xticks(x, conds)
    ax.set_xlabel("noise ratio" if key == "accuracy" and not conds[0].startswith("cf") else "condition")
    ax.set_ylabel("cover EM (%)" if key == "accuracy" else "counterfactual repeat (%)")
    ax.set_title(title or f"n = {summary['n_items']} items")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return p


def plot_auc(summary: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """AUC bar per scorer (token level)."""
    plt = _plt()
    names = list(summary["scorers"])
    vals = [summary["scorers"][n]["auc"] for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    colors = ["#c44" if n in ("logprob", "entropy") else "#468" for n in names]
    ax.barh(names, vals, color=colors)
    ax.axvline(50, color="gray", linestyle="--", linewidth=1)
    for i, v in enumerate(vals):
        if not math.isnan(v):
            ax.text(v + 0.5, i, f"{v:.1f}", va="center", fontsize=8)
    ax.set_xlabel("AUC (%)")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_title(title or f"token level: {summary['n_samples']} samples ({summary['n_benefit']} benefit)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return p


def write_accuracy_report(summary: dict[str, Any], out_dir: str | Path, name: str, title: str, command: str = "") -> list[Path]:
    """``<name>.json``, ``<name>.md`` and ``<name>.png`` (+ ``<name>_cf_repeat.png``) in out_dir."""
    out = Path(out_dir)
    files = [write_json(out / f"{name}.json", {**summary, "command": command})]
    md = [f"## {title}", ""]
    if command:
        md += ["```", command, "```", ""]
    md += ["Accuracy (cover EM, %):", "", accuracy_table(summary), ""]
    # Repeat rates only mean something where counterfactual passages were given.
    has_cf = any(summary.get("mean_passages", {}).get(c, {}).get("cf") for c in summary["conditions"])
    if has_cf:
        md += ["Answers repeating the counterfactual answer (%):", "", accuracy_table(summary, "cf_repeat"), ""]
    md += ["Passages given:", "", passages_table(summary), ""]
    md += ["Mean seconds per question: " + ", ".join(f"{p} {_fmt(summary['mean_time_s'][p], 2)}" for p in summary["policies"]), ""]
    (out / f"{name}.md").write_text("\n".join(md), encoding="utf-8")
    files.append(out / f"{name}.md")
    files.append(plot_accuracy(summary, out / f"{name}.png", f"{title} (n = {summary['n_items']})"))
    if has_cf:
        files.append(plot_accuracy(summary, out / f"{name}_cf_repeat.png", title + " (counterfactual repeats)", key="cf_repeat"))
    return files


def write_token_report(summary: dict[str, Any], out_dir: str | Path, name: str, title: str, command: str = "") -> list[Path]:
    out = Path(out_dir)
    files = [write_json(out / f"{name}.json", {**summary, "command": command})]
    md = [f"## {title}", ""]
    if command:
        md += ["```", command, "```", ""]
    md += [
        f"{summary['n_samples']} labelled positions ({summary['n_benefit']} where only RAG predicts the gold token).",
        "",
        token_table(summary),
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(md), encoding="utf-8")
    files.append(out / f"{name}.md")
    files.append(plot_auc(summary, out / f"{name}.png", title))
    return files
