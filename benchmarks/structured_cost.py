"""What a constraint costs per token on the packaged model (issue 57: constrained decoding
<= 1.10x the unconstrained decode per token, measured interleaved).

Arms, interleaved in each round on the same prompts (the sample questions with the paragraph
that holds each answer; ``tokrag``, greedy, ``max_new_tokens`` tokens):

* ``plain``: no constraint;
* ``free``: the regex ``(.|\\n)*``: every token allowed, so the tokens are the plain arm's
  (checked) while the mask is still computed, applied and stepped at every token: the
  constraint's whole cost on the same work;
* ``auto``: tools offered under ``tool_choice="auto"`` (free text until ``<tool_call>``);
* ``json``: a JSON schema (other tokens than plain: compared per token).

Each arm's thread time (``time.thread_time``; the decode runs on the calling thread) per
generated token, the median over rounds, the ratio to ``plain``, and the time spent inside the
constraint (``fill_bitmask`` + ``accept``) per token.

    python benchmarks/structured_cost.py [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _structured import sample_questions  # noqa: E402

from tokrag_integrations import generate, load_model  # noqa: E402
from tokrag_integrations.structured import constraint_for, response_format_of, tool_call_constraint  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "string", "enum": ["high", "low"]}},
    "required": ["answer", "confidence"],
}


def search_documents(query: str) -> str:
    """Search the company's documents.

    Args:
        query: what to look for
    """
    return query


class Timed:
    """A constraint whose own calls are timed (thread time)."""

    def __init__(self, inner, clock):
        self.inner, self.clock = inner, clock

    def fill_bitmask(self, bitmask, index):
        t = time.thread_time()
        self.inner.fill_bitmask(bitmask, index)
        self.clock[0] += time.thread_time() - t

    def accept(self, token_id):
        t = time.thread_time()
        self.inner.accept(token_id)
        self.clock[0] += time.thread_time() - t

    def is_finished(self):
        return self.inner.is_finished()

    def fork(self):
        return Timed(self.inner.fork(), self.clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--questions", type=int, default=3)
    args = parser.parse_args()

    lm = load_model("default", device="cpu")
    qs = sample_questions(args.questions)  # the prompts of tests/integration/test_structured.py
    arms = {
        "plain": lambda: None,
        "free": lambda: constraint_for({"type": "regex", "regex": r"(.|\n)*"}, lm),
        "auto": lambda: tool_call_constraint([search_documents], "auto", lm),
        "json": lambda: constraint_for(response_format_of(SCHEMA), lm),
    }
    per_token: dict[str, list[float]] = {a: [] for a in arms}
    inside: dict[str, list[float]] = {a: [] for a in arms}
    plain_ids: dict[str, list[int]] = {}
    for make in arms.values():  # warm-up: compile each grammar once, load the speed paths
        c = make()
        generate(lm, qs[0][0], qs[0][1], max_new_tokens=4, constraint=c)
    for _ in range(args.rounds):
        for name, make in arms.items():
            clock = [0.0]
            tokens = 0
            start = time.thread_time()
            for q, passages in qs:
                c = make()
                r = generate(lm, q, passages, max_new_tokens=args.tokens,
                             constraint=None if c is None else Timed(c, clock))
                tokens += len(r.token_ids)
                if name == "plain":
                    plain_ids[q] = r.token_ids
                elif name == "free":
                    assert r.token_ids == plain_ids[q], "the free-text constraint changed the tokens"
            per_token[name].append((time.thread_time() - start) / tokens)
            inside[name].append(clock[0] / tokens)
    base = statistics.median(per_token["plain"])
    print(f"{args.rounds} rounds x {len(qs)} questions x <= {args.tokens} tokens, tokrag, greedy, CPU")
    print(f"{'arm':<6} {'ms/token':>9} {'x plain':>8} {'in constraint ms/token':>23}")
    for name in arms:
        m = statistics.median(per_token[name])
        print(f"{name:<6} {m * 1e3:9.2f} {m / base:8.3f} {statistics.median(inside[name]) * 1e3:23.3f}")


if __name__ == "__main__":
    main()
