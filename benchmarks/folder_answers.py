"""Answers, not only recall: SQuAD dev questions answered from a folder retrieved by dense and
by hybrid (``tokrag ask --docs --retriever``), top 5 chunks, the packaged model.

    nice -n 10 python benchmarks/folder_answers.py --questions 150 --json benchmarks/results/folder_answers.json

The folder is ``folder_recall.py``'s SQuAD set (every dev paragraph a file). A question is
answered when the answer contains a gold answer (``cover_em``, as ``tokrag eval``). Printed
per retriever and policy: accuracy with its 95 % Wilson interval, and the paired difference
hybrid - dense with a 95 % percentile bootstrap over questions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_retrieval import SQUAD, load_squad  # noqa: E402
from folder_recall import wilson  # noqa: E402

from tokrag_eval.metrics import cover_em  # noqa: E402
from tokrag_integrations import Passage, generate_batch, load_model  # noqa: E402
from tokrag_integrations.defaults import ANSWER_STOP, MAX_NEW_TOKENS, TOP_K  # noqa: E402
from tokrag_integrations.retrieval import build_retriever  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=150)
    ap.add_argument("--policies", default="rag,tokrag")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    items = [json.loads(line) for line in SQUAD.read_text(encoding="utf-8").splitlines()]
    picked = sorted(random.Random(args.seed).sample(range(len(items)), args.questions))
    paragraphs, _ = load_squad(SQUAD)
    lm = load_model("default")
    hits: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for i, text in enumerate(paragraphs):
            (folder / f"p{i:05d}.txt").write_text(text + "\n", encoding="utf-8")
        for kind in ("dense", "hybrid"):
            retriever = build_retriever(folder, kind=kind, cache=True)
            questions = [items[i]["question"] for i in picked]
            passages = [
                [Passage(h.text, score=h.score) for h in retriever.retrieve(q, top_k=TOP_K)]
                for q in questions
            ]
            for policy in args.policies.split(","):
                got = []
                for s in range(0, len(questions), args.batch):
                    results = generate_batch(
                        lm,
                        questions[s : s + args.batch],
                        passages[s : s + args.batch],
                        policy=policy,
                        max_new_tokens=MAX_NEW_TOKENS,
                        stop=list(ANSWER_STOP),
                    )
                    got += [
                        int(cover_em(r.text, items[picked[s + j]]["answers"]))
                        for j, r in enumerate(results)
                    ]
                hits[f"{kind}/{policy}"] = got
                print(f"{kind:7s} {policy:7s} {sum(got)}/{len(got)}", flush=True)
    n = args.questions
    out: dict[str, object] = {"questions": n, "seed": args.seed, "top_k": TOP_K}
    print(f"\n| retriever / policy | answered (of {n}) | 95 % interval |\n| --- | --- | --- |")
    for key, got in hits.items():
        lo, hi = wilson(sum(got), n)
        out[key] = {"accuracy": round(sum(got) / n, 3), "ci95": [round(lo, 3), round(hi, 3)]}
        print(f"| {key} | {sum(got) / n:.3f} | [{lo:.3f}, {hi:.3f}] |")
    rng = random.Random(1)
    for policy in args.policies.split(","):
        a, b = hits[f"hybrid/{policy}"], hits[f"dense/{policy}"]
        diffs = [x - y for x, y in zip(a, b, strict=True)]
        boot = sorted(
            sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(2000)
        )
        lo, hi = boot[50], boot[1949]
        out[f"hybrid-dense/{policy}"] = {"diff": round(sum(diffs) / n, 3), "ci95": [lo, hi]}
        print(f"hybrid - dense ({policy}): {sum(diffs) / n:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    out["hits"] = hits
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
