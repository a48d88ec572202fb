"""The first hour: how many of the ten packaged sample questions each policy answers.

A new user's first answers come from ``tokrag ask QUESTION --docs sample`` (``--retriever``
retrieval over the packaged company documents, 5 chunks, ``stream``). This script asks the
ten questions of ``sample_questions.json`` the same way, for every policy spec and every
number of retrieved chunks, and prints which questions each answers (the expected answer or
one of its aliases in the text, by the harness's cover EM) and the count. The questions are the ones
the sample documents were written around, not an evaluation set: use it to see what a user
sees, and the dev sets (``tokrag eval``) to choose anything.

    python benchmarks/sample_questions.py
    python benchmarks/sample_questions.py --policies 'rag,tokrag,tokrag[plausibility_alpha=0.1]' --top-k 3,5
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from tokrag_eval.metrics import cover_em
from tokrag_eval.specs import parse_specs
from tokrag_integrations import Passage, generate, load_model
from tokrag_integrations.defaults import RETRIEVER
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="rag,tokrag,tokrag[plausibility_alpha=0.1]")
    ap.add_argument("--top-k", default="3,5", help="comma-separated numbers of retrieved chunks")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="as tokrag ask (default 64)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--retriever", choices=("dense", "bm25", "hybrid"), default=RETRIEVER)
    ap.add_argument("--json", default=None, help="also write the answers to this JSON file")
    args = ap.parse_args()

    specs = parse_specs(args.policies)
    ks = [int(k) for k in args.top_k.split(",")]
    lm = load_model(args.model)
    retriever = build_retriever(get_sample_docs_path(), kind=args.retriever)
    questions = get_sample_questions()
    rows: list[dict[str, Any]] = []
    for k in ks:
        print(f"\n== {k} chunks ==")
        passages = [
            [Passage(text=h.text, score=h.score) for h in retriever.retrieve(q["question"], top_k=k)]
            for q in questions
        ]
        for spec in specs:
            marks = []
            for q, ps in zip(questions, passages, strict=True):
                r = generate(
                    lm, q["question"], ps, policy=spec.name,
                    max_new_tokens=args.max_new_tokens, **spec.options,
                )
                ok = cover_em(r.text, [q["answer"], *q.get("aliases", [])])
                marks.append("+" if ok else ".")
                rows.append(
                    {"top_k": k, "policy": str(spec), "question": q["question"], "correct": ok, "text": r.text}
                )
            print(f"{''.join(marks)}  {marks.count('+'):2d} / {len(questions)}  {spec}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
