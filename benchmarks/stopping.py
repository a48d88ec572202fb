"""How many answers run to the token cap, without and with the default stop strings.

Asks every question the way ``tokrag ask QUESTION --docs FOLDER`` does (dense MiniLM
retrieval over the folder with the default chunking and top-k, the embeddings cache on,
``max_new_tokens`` = the default) under each policy, and prints per policy the share of
answers cut at the cap and the correct answers (cover EM against the expected answer and
its aliases), before (no stop strings: the model's end of turn or the cap) and after (the
default :data:`tokrag_integrations.defaults.ANSWER_STOP`).

Decoding is greedy, so an answer decoded with stop strings is the answer decoded without
them, cut where the first stop string appears; by default one run without stops gives both
columns (``--check`` decodes again with the stops and asserts exactly that).

    python benchmarks/stopping.py                                  # the packaged sample docs
    python benchmarks/stopping.py --questions benchmarks/outside_docs_questions.json \\
        --docs /tmp/outside_docs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokrag_eval.metrics import cover_em
from tokrag_integrations import Passage, generate, load_model
from tokrag_integrations.defaults import ANSWER_STOP, MAX_NEW_TOKENS, TOP_K
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


def cut_at_stop(text: str, stops: tuple[str, ...] | list[str]) -> tuple[str, bool]:
    """(``text`` up to its first stop string, whether one was found)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def load_questions(path: str | None) -> list[dict[str, Any]]:
    if path is None:
        return get_sample_questions()
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return data["questions"] if isinstance(data, dict) else data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", default=None, help="JSON file (default: the sample questions)")
    ap.add_argument("--docs", default=None, help="folder (default: the packaged sample docs)")
    ap.add_argument("--policies", default="rag,tokrag")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--check", action="store_true", help="also decode with the stops and compare")
    ap.add_argument("--json", default=None, help="write every answer to this file")
    args = ap.parse_args()

    questions = load_questions(args.questions)
    docs = Path(args.docs) if args.docs else get_sample_docs_path()
    lm = load_model("default")
    retriever = build_retriever(docs, cache=True)
    passages = [
        [
            Passage(text=h.text, score=h.score, metadata={"source": h.source})
            for h in retriever.retrieve(q["question"], top_k=args.top_k)
        ]
        for q in questions
    ]
    rows: list[dict[str, Any]] = []
    print(f"{len(questions)} questions, {docs}, max_new_tokens {args.max_new_tokens}, "
          f"top-k {args.top_k}, stops {list(ANSWER_STOP)!r}")
    for policy in args.policies.split(","):
        cap_before = cap_after = ok_before = ok_after = 0
        marks = []
        for q, ps in zip(questions, passages, strict=True):
            gold = [q["answer"], *q.get("aliases", [])]
            r = generate(lm, q["question"], ps, policy=policy, max_new_tokens=args.max_new_tokens, stop=[])
            after, stopped = cut_at_stop(r.text, ANSWER_STOP)
            capped = r.stop_reason == "length"
            cap_before += capped
            cap_after += capped and not stopped
            ok_b, ok_a = cover_em(r.text, gold), cover_em(after, gold)
            ok_before += ok_b
            ok_after += ok_a
            marks.append("+" if ok_a else ".")
            if args.check:
                s = generate(lm, q["question"], ps, policy=policy, max_new_tokens=args.max_new_tokens, stop=list(ANSWER_STOP))
                assert s.text == after, (s.text, after)
                assert (s.stop_reason == "length") == (capped and not stopped), s.stop_reason
            rows.append({
                "policy": policy, "question": q["question"], "answer": q["answer"],
                "sources": [p.metadata["source"] for p in ps],
                "text_no_stop": r.text, "stop_reason_no_stop": r.stop_reason,
                "n_tokens_no_stop": len(r.token_ids), "text": after,
                "cut_at_cap": capped and not stopped, "correct_no_stop": ok_b, "correct": ok_a,
            })
        n = len(questions)
        print(
            f"{policy:8s} cut at the cap: {cap_before}/{n} without stops -> {cap_after}/{n} with; "
            f"correct {ok_before}/{n} -> {ok_after}/{n}  {''.join(marks)}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
