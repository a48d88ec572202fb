"""How far can a rule that chooses between the pure model and RAG get above ``rag``?

Reads the per-item records of a ``tokrag eval noise`` / ``tokrag eval misleading`` run that
holds ``no_rag`` and ``rag`` (and any other policies) and prints, per condition and as the mean
over conditions:

* the **selection ceiling**: an item counts as correct when ``rag`` or ``no_rag`` answers it
  correctly (an oracle that picks the better of the two whole answers). A token-level rule
  can also compose an answer that neither context gives alone, so this is not a strict bound
  for Tok-RAG, but it says how much of the pure model's own knowledge there is to recover:
  the items that only ``no_rag`` answers;
* for every other policy: its accuracy, the items it answers that ``rag`` misses (wins) and
  the items ``rag`` answers that it misses (losses), and the paired difference to ``rag``
  with its 95 % bootstrap interval over items (the harness's own resampling).

    python benchmarks/selection_ceiling.py runs/noise_rgb_en_fact_dev.jsonl
    python benchmarks/selection_ceiling.py runs/misleading_conflictqa_strategyqa_dev.jsonl
    python benchmarks/selection_ceiling.py runs/misleading_conflictqa_strategyqa_dev.jsonl --key cf_repeat --lower-is-better
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from tokrag_eval.metrics import bootstrap_ci, paired_bootstrap_diff

NO_PASSAGES = "none"


def load(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def matrices(
    records: list[dict[str, Any]], key: str, best: Any = max
) -> tuple[list[str], list[str], dict[str, list[list[float]]]]:
    """Items × conditions matrices (100 / 0) per policy, over the items ``no_rag`` and ``rag``
    have in every condition (``no_rag``, decoded once as condition ``none``, fills every
    condition); a policy without a record for each of those is left out, and named."""
    cell: dict[str, dict[tuple[str, str], bool | None]] = defaultdict(dict)
    for r in records:
        cell[r["policy"]][(r["item"], r["condition"])] = (
            None if r.get(key) is None else bool(r[key])
        )
    conditions = list(
        dict.fromkeys(r["condition"] for r in records if r["condition"] != NO_PASSAGES)
    )
    if "no_rag" not in cell or "rag" not in cell:
        raise SystemExit(
            "the records need both 'no_rag' and 'rag' (run the eval with --policies no_rag,rag,...)"
        )

    def value(policy: str, item: str, cond: str) -> bool | None:
        got = cell[policy].get((item, cond))
        return cell[policy].get((item, NO_PASSAGES)) if got is None else got

    # Items in the order the run met them (the data file's order), as the harness resamples.
    items = [
        i
        for i in dict.fromkeys(r["item"] for r in records)
        if all(value(p, i, c) is not None for p in ("no_rag", "rag") for c in conditions)
    ]
    # A policy still running (or missing items) is left out rather than shrinking the items.
    complete = [
        p for p in cell if all(value(p, i, c) is not None for i in items for c in conditions)
    ]
    for p in sorted(set(cell) - set(complete)):
        print(f"left out: {p} (no record for every item and condition yet)")
    if not items:
        raise SystemExit("no item has no_rag and rag records in every condition")
    out = {p: [[100.0 * bool(value(p, i, c)) for c in conditions] for i in items] for p in complete}
    out["ceiling (rag or no_rag)"] = [
        [best(a, b) for a, b in zip(ra, rl, strict=True)]
        for ra, rl in zip(out["rag"], out["no_rag"], strict=True)
    ]
    return items, conditions, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, help="a records file of tokrag eval (runs/<name>.jsonl)")
    ap.add_argument("--key", default="correct", help="record field to count (default: correct)")
    ap.add_argument(
        "--lower-is-better",
        action="store_true",
        help="the field counts failures (cf_repeat: the answer repeats the counterfactual): the "
        "ceiling takes the better, lower of rag and no_rag, and a win is a lower value than rag's",
    )
    args = ap.parse_args()
    lower = args.lower_is_better
    items, conditions, m = matrices(load(args.records), args.key, best=min if lower else max)
    n = len(items)
    print(
        f"{args.records.name}: {n} items, conditions {', '.join(conditions)}, field '{args.key}'\n"
    )
    head = (
        "| policy | "
        + " | ".join(conditions)
        + " | mean [95 % CI] | − rag [95 % CI] | wins / losses vs rag |"
    )
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    order = ["rag", "ceiling (rag or no_rag)", "no_rag"] + sorted(
        p for p in m if p not in ("rag", "no_rag", "ceiling (rag or no_rag)")
    )
    for p in order:
        rows = m[p]
        per = [sum(r[j] for r in rows) / n for j in range(len(conditions))]
        lo, hi = bootstrap_ci(rows)
        mean = sum(per) / len(per)
        if p == "rag":
            diff, wl = "", ""
        else:
            d = paired_bootstrap_diff(rows, m["rag"])
            diff = f"{d['diff']:+.1f} [{d['ci'][0]:+.1f}, {d['ci'][1]:+.1f}]"
            wins = sum(
                (a < b) if lower else (a > b)
                for ra, rb in zip(rows, m["rag"], strict=True)
                for a, b in zip(ra, rb, strict=True)
            )
            losses = sum(
                (a > b) if lower else (a < b)
                for ra, rb in zip(rows, m["rag"], strict=True)
                for a, b in zip(ra, rb, strict=True)
            )
            wl = f"{wins} / {losses}"
        cells = " | ".join(f"{v:.1f}" for v in per)
        ci = "" if math.isnan(lo) else f" [{lo:.1f}, {hi:.1f}]"
        print(f"| {p} | {cells} | {mean:.1f}{ci} | {diff} | {wl} |")
    only_llm = sum(
        ((a < b) if lower else (a > b))
        for ra, rb in zip(m["no_rag"], m["rag"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    print(
        f"\n(item, condition) pairs where only llm is right (better than rag): {only_llm} of {n * len(conditions)}"
    )


if __name__ == "__main__":
    main()
