#!/bin/bash
# `tokrag bench` on two checkouts of the package, interleaved (before, after, before, after),
# in one Python environment: per question (rag and tokrag, --questions 20) and throughput
# (--throughput 4,16). Each run writes its JSON figures to OUT; compare them side by side.
#
#   benchmarks/compare_checkouts.sh BEFORE_CHECKOUT AFTER_CHECKOUT DATA.jsonl OUT [ROUNDS]
#
# Example (the redesign of issue 44, docs/results.md):
#   git worktree add --detach /tmp/before 3abfb1e
#   benchmarks/compare_checkouts.sh /tmp/before . ../shared/data/squad_dev.jsonl /tmp/cmp 2
set -euo pipefail
before=$1 after=$2 data=$3 out=$4 rounds=${5:-2}
py=${PYTHON:-python}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    src=$before/src; [ "$side" = after ] && src=$after/src
    PYTHONPATH=$src "$py" -m tokrag_integrations.cli bench --data "$data" --questions 20 \
      --no-memory --policies rag,tokrag --json "$out/q_${side}_$round.json" > "$out/q_${side}_$round.txt" 2>&1
    PYTHONPATH=$src "$py" -m tokrag_integrations.cli bench --data "$data" --questions 16 \
      --throughput 4,16 --throughput-only --rounds 1 --policies rag,tokrag \
      --json "$out/t_${side}_$round.json" > "$out/t_${side}_$round.txt" 2>&1
  done
done
"$py" - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for r in range(1, rounds + 1):
    q = {s: json.load(open(f"{out}/q_{s}_{r}.json")) for s in ("before", "after")}
    t = {s: json.load(open(f"{out}/t_{s}_{r}.json")) for s in ("before", "after")}
    for pol in ("rag", "tokrag"):
        b, a = (q[s]["policies"][pol]["s_per_question"] for s in ("before", "after"))
        print(f"round {r} {pol} s/question: before {b:.3f}  after {a:.3f}  after/before {a / b:.3f}")
        for bs in ("4", "16"):
            b, a = (t[s]["throughput"]["arms"][pol][bs]["tokens_per_s"] for s in ("before", "after"))
            print(f"round {r} {pol} batch {bs} tokens/s: before {b:.2f}  after {a:.2f}  after/before {a / b:.3f}")
PY
