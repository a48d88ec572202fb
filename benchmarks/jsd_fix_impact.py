"""What the JSD fix changed: Tok-RAG with the fixed g(l) vs the JSD as it was before.

Before the fix, ``signals.jsd`` took ``log`` of the mixture m = (p + q) / 2 without a floor.
Logit-lens distributions of peaked layers (the default lens has no final norm) hold
probabilities below 1e-45; half of one rounds to 0 in float32, log m was -inf, the layer's
JSD inf and g(l) = |inf - inf| NaN, which never crosses the threshold: the fusion layer's JSD
term moved to a later layer (often L). This decodes the same dev questions as
``exactness.py`` (60, noisy passages, 64 new tokens) with the fixed JSD and with the old one
(reproduced here), and counts how many signal steps got NaN, how many l* and benefit
decisions changed, how many answers changed, and cover EM of both.

    python benchmarks/jsd_fix_impact.py --per-set 20 --json benchmarks/results/jsd_fix_impact.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SETS = ("squad", "rgb_en_fact", "conflictqa_strategyqa")
RATIOS = (0.2, 0.4, 0.6, 0.8)


def old_layer_shift_jsd_logp(lens_logp: torch.Tensor) -> torch.Tensor:
    """The JSD between consecutive lens layers as computed before the fix (no floor on m)."""
    p, q = lens_logp[:-1].exp(), lens_logp[1:].exp()
    m = 0.5 * (p + q)
    kl_pm = (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1)
    kl_qm = (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(-1)
    return (0.5 * kl_pm + 0.5 * kl_qm).clamp_min(0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-set", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tokrag_eval.data import load_items, mix_passages
    from tokrag_eval.metrics import cover_em
    from tokrag_integrations import generate, load_model
    from tokrag_integrations.policies import signals as S

    lm = load_model("default", device="cpu")
    cases = []
    for name in SETS:
        for i, it in enumerate(load_items(DATA / f"{name}_dev.jsonl", args.per_set)):
            mix = mix_passages(it, RATIOS[i % len(RATIOS)], k=5)
            if mix.passages:
                cases.append((f"{name}:{it.id}", it, mix.passages))

    fixed = S.layer_shift_jsd_logp
    nan_steps = [0]

    def old(lens_logp: torch.Tensor) -> torch.Tensor:
        out = old_layer_shift_jsd_logp(lens_logp)
        if not torch.isfinite(out).all():
            nan_steps[0] += 1
        return out

    rows = []
    totals = dict.fromkeys(
        ("signal_steps", "l_star_changed", "benefit_changed", "compared_steps"), 0
    )
    em = {"fixed": 0, "old": 0}
    for cid, it, ps in tqdm(cases, desc="fixed vs old JSD"):
        res = {}
        for tag, fn in (("fixed", fixed), ("old", old)):
            S.layer_shift_jsd_logp = fn
            try:
                res[tag] = generate(
                    lm, it.question, ps, policy="tokrag", max_new_tokens=args.max_new_tokens
                )
            finally:
                S.layer_shift_jsd_logp = fixed
            em[tag] += int(cover_em(res[tag].text, it.answers))
        a, b = res["fixed"].trace.steps, res["old"].trace.steps
        same_prefix = 0
        for x, y in zip(a, b, strict=False):
            if x.token_id != y.token_id:
                break
            same_prefix += 1
        # Decisions are comparable up to the first differing token (the same states).
        for x, y in zip(a[: same_prefix + 1], b[: same_prefix + 1], strict=False):
            if "l_star" in x.signals and "l_star" in y.signals:
                totals["compared_steps"] += 1
                totals["l_star_changed"] += int(x.signals["l_star"] != y.signals["l_star"])
                totals["benefit_changed"] += int(x.signals["benefit"] != y.signals["benefit"])
        totals["signal_steps"] += sum(1 for s in a if "l_star" in s.signals)
        rows.append(
            {
                "id": cid,
                "answer_changed": res["fixed"].token_ids != res["old"].token_ids,
                "fixed": res["fixed"].text,
                "old": res["old"].text,
            }
        )
    summary = {
        "questions": len(rows),
        **totals,
        "old_jsd_calls_with_inf_or_nan": nan_steps[0],
        "answers_changed": sum(r["answer_changed"] for r in rows),
        "cover_em_fixed": em["fixed"] / max(1, len(rows)),
        "cover_em_old": em["old"] / max(1, len(rows)),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"summary": summary, "rows": rows}, indent=1), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
