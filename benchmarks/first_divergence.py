"""Where a policy's answers part from `rag`'s, in the conditions exactly one of them gets right.

    python benchmarks/first_divergence.py RECORDS.jsonl 'POLICY LABEL'

Reads the per-item records of ``tokrag eval`` (``--records``). For every (item, condition)
that ``rag`` alone answers right, prints the first step whose chosen token differs from
``rag``'s: the token chosen, its source, the gate note if one decided, and cos_llm; then
counts them by source and by whether that step is the answer's first. Used for the "why" of
the second model in docs/results.md (issue 28).
"""

from __future__ import annotations

import collections
import json
import sys


def main(path: str, policy: str) -> None:
    index = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            index[(r["item"], r["condition"], r["policy"])] = r
    cells = sorted({(i, c) for (i, c, p) in index if p == policy and (i, c, "rag") in index})
    rag_only = [(i, c) for i, c in cells if index[(i, c, "rag")]["correct"] and not index[(i, c, policy)]["correct"]]
    pol_only = [(i, c) for i, c in cells if index[(i, c, policy)]["correct"] and not index[(i, c, "rag")]["correct"]]
    print(f"{len(cells)} conditions; rag alone right: {len(rag_only)}; {policy} alone right: {len(pol_only)}")
    kinds: collections.Counter = collections.Counter()
    for i, c in rag_only:
        mine, theirs = index[(i, c, policy)]["trace"]["steps"], index[(i, c, "rag")]["trace"]["steps"]
        for k, (s, t) in enumerate(zip(mine, theirs, strict=False)):
            if s["token_id"] != t["token_id"]:
                sig = s.get("signals") or {}
                kinds[(s["source"], sig.get("note"), "first token" if k == 0 else "later")] += 1
                print(f"  {i} {c} step {k}: {s['text']!r} ({s['source']}) against rag's {t['text']!r}; "
                      f"note={sig.get('note')} cos_llm={sig.get('cos_llm')}")
                break
    for key, n in kinds.most_common():
        print(n, key)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
