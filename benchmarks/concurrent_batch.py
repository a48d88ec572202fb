"""8 concurrent questions through ChatTokRAG.abatch: micro-batched against one at a time.

    python benchmarks/concurrent_batch.py [--n 8] [--policy tokrag] [--max-tokens 32] [--repeats 2]

Both arms answer the same questions with the same passages (BM25 top 3 over the packaged
sample documents) in the same run, alternating arms per repeat; prints wall time per arm,
the throughput ratio and how many answers are identical.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tokrag_integrations import load_model
from tokrag_integrations.engine.scheduler import batcher_for
from tokrag_integrations.langchain import ChatTokRAG
from tokrag_integrations.retrieval import (
    build_retriever,
    get_sample_docs_path,
    get_sample_questions,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--policy", default="tokrag")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    lm = load_model("default")
    ret = build_retriever(get_sample_docs_path(), "bm25")
    qs = [q["question"] for q in get_sample_questions()]
    qs = (qs * (args.n // len(qs) + 1))[: args.n]
    bound = {
        arm: [
            ChatTokRAG(model=lm, policy=args.policy, max_tokens=args.max_tokens, batching=arm == "batched")
            .bind(passages=[h.text for h in ret.retrieve(q, top_k=3)])
            for q in qs
        ]
        for arm in ("batched", "one at a time")
    }

    async def run(arm: str) -> tuple[float, list[str]]:
        t = time.perf_counter()
        outs = await asyncio.gather(*(m.ainvoke(q) for m, q in zip(bound[arm], qs, strict=True)))
        return time.perf_counter() - t, [o.content for o in outs]

    asyncio.run(run("batched"))  # warm-up
    times: dict[str, list[float]] = {"batched": [], "one at a time": []}
    answers: dict[str, list[str]] = {}
    b = batcher_for(lm)
    for r in range(args.repeats):
        for arm in (("batched", "one at a time") if r % 2 == 0 else ("one at a time", "batched")):
            s, answers[arm] = asyncio.run(run(arm))
            times[arm].append(s)
    same = sum(a == c for a, c in zip(answers["batched"], answers["one at a time"], strict=True))
    tb, to = min(times["batched"]), min(times["one at a time"])
    print(f"model {lm.name}, policy {args.policy}, {args.n} concurrent questions, "
          f"max_tokens {args.max_tokens}, best of {args.repeats}")
    print(f"batched: {tb:.2f} s ({args.n / tb:.2f} questions/s); one at a time: {to:.2f} s "
          f"({args.n / to:.2f} questions/s)")
    print(f"throughput ratio batched / one at a time: {to / tb:.2f}x")
    print(f"identical answers: {same} / {args.n}; batched decodes run: {b.batches}, "
          f"calls they served: {b.batched_calls}")


if __name__ == "__main__":
    main()
