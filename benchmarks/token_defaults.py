"""Token-level AUC/F1 of Tok-RAG option combinations (the run behind the default change).

    python benchmarks/token_defaults.py [--limit 8] [--records-dir runs/token_defaults]

Same protocol as ``tokrag eval token`` (Table 3), with option *combinations* as scorers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokrag_eval.data import load_items
from tokrag_eval.records import RecordStore
from tokrag_eval.token_level import run_token_level, summarize_token_level
from tokrag_integrations import load_model

CONFIGS = {
    "paper as written": {"top_k": None, "lens_norm": True},
    "top_k=3": {"top_k": 3, "lens_norm": True},
    "lens_norm=False": {"top_k": None, "lens_norm": False},
    "top_k=3,lens_norm=False (default)": {"top_k": 3, "lens_norm": False},
    "top_k=2,lens_norm=False": {"top_k": 2, "lens_norm": False},
    "top_k=3,lens_norm=False,min_fusion_layer=9": {"top_k": 3, "lens_norm": False, "min_fusion_layer": 9},
    "authors": {"policy": "tokrag_authors"},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--records-dir", default="runs/token_defaults")
    args = ap.parse_args()
    lm = load_model()
    out = Path(args.records_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = [
        ("rgb_en_fact_dev", {"ratios": (0.0, 1.0), "cf_ratios": (1.0,)}),
        ("squad_dev", {"ratios": (0.0, 1.0), "cf_ratios": ()}),
    ]
    for name, kw in sets:
        items = load_items(Path(args.data_dir) / f"{name}.jsonl", limit=args.limit)
        run_token_level(lm, items, records_path=out / f"{name}.jsonl", tokrag_configs=CONFIGS, **kw)
    recs = [r for name, _ in sets for r in RecordStore(out / f"{name}.jsonl").values()]
    s = summarize_token_level(recs)
    print(f"{s['n_samples']} labelled positions, {s['n_samples'] - s['n_benefit']} with label 0")
    print("| Tok-RAG options | AUC | F1 | macro-F1 |\n|---|---|---|---|")
    for k, v in s["scorers"].items():
        print(f"| {k} | {v['auc']:.1f} | {v['f1']:.1f} | {v['macro_f1']:.1f} |")
    (out / "summary.json").write_text(json.dumps(s, indent=1, default=str))


if __name__ == "__main__":
    main()
