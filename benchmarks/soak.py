"""Mixed-load soak: LangChain, LlamaIndex and raw streams from many threads on ONE model.

    OMP_NUM_THREADS=1 nice python benchmarks/soak.py --threads 6 --seconds 120

Each call is one of six kinds, all greedy, on one ``LoadedModel`` shared by every thread:

* ``langchain invoke`` / ``langchain stream``: ``ChatTokRAG.invoke`` / ``.stream`` with
  ``passages=``;
* ``llamaindex complete`` / ``llamaindex stream_chat``: ``TokRAGLLM.complete`` /
  ``.stream_chat`` with ``passages=``;
* ``stream``: the core :func:`tokrag_integrations.stream`, read to its end;
* ``stream closed``: the core stream, two tokens read, then closed (from another thread
  every other time).

First every (kind, question) pair runs **alone**, one at a time, to record its answer. Then
``--threads`` threads call random pairs for ``--seconds``; a call whose answer differs from
the same call run alone is a **mismatch** (for ``stream closed``: its first two tokens), a
call that raises is an **error**, a call still running after ``--hang-after`` seconds is a
**hang**. Prints ``calls N / errors E / hangs H / mismatches M`` and exits 1 unless
E = H = M = 0. Micro-batching (the adapters' default) is on, so concurrent calls of the
adapters are decoded in shared batches: a mismatch there would be a batching bug.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: (question, passage) pairs with a fictional fact, so the RAG context matters.
CASES = [
    ("Who founded Quillfeather Aerospace?", "Quillfeather Aerospace was founded in 2011 by Ottoline Varga in Tromsø."),
    ("What is the code name of the Kestrel-7 programme?", "The Kestrel-7 programme is known internally by its code name Bramblewick."),
    ("Which Slack channel is used for SEV-1 incidents?", "SEV-1 incidents are coordinated in the #sev1-bridge Slack channel."),
    ("What is the guest Wi-Fi network at the Dundee office called?", "The Dundee office's guest Wi-Fi network is QF-Guest-Larch."),
]
KINDS = (
    "langchain invoke",
    "langchain stream",
    "llamaindex complete",
    "llamaindex stream_chat",
    "stream",
    "stream closed",
)


def build_calls(lm: Any, max_new_tokens: int) -> dict[str, Callable[[str, str, int], str]]:
    """One function per kind: ``call(question, passage, i) -> answer text``."""
    from llama_index.core.llms import ChatMessage

    from tokrag_integrations import stream
    from tokrag_integrations.langchain import ChatTokRAG
    from tokrag_integrations.llama_index import TokRAGLLM

    chat = ChatTokRAG(model=lm, max_tokens=max_new_tokens)
    llm = TokRAGLLM(lm=lm, max_new_tokens=max_new_tokens)

    def langchain_invoke(q: str, p: str, i: int) -> str:
        return str(chat.invoke(q, passages=[p]).content)

    def langchain_stream(q: str, p: str, i: int) -> str:
        return "".join(str(c.content) for c in chat.stream(q, passages=[p]))

    def llamaindex_complete(q: str, p: str, i: int) -> str:
        return llm.complete(q, passages=[p]).text

    def llamaindex_stream_chat(q: str, p: str, i: int) -> str:
        return "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", content=q)], passages=[p]))

    def core_stream(q: str, p: str, i: int) -> str:
        return "".join(ev.text for ev in stream(lm, q, [p], max_new_tokens=max_new_tokens))

    def core_stream_closed(q: str, p: str, i: int) -> str:
        s = stream(lm, q, [p], max_new_tokens=max_new_tokens)
        ids = [next(s).token_id, next(s).token_id]
        if i % 2:
            closer = threading.Thread(target=s.close)
            closer.start()
            closer.join()
        else:
            s.close()
        return " ".join(map(str, ids))

    return dict(
        zip(
            KINDS,
            (langchain_invoke, langchain_stream, llamaindex_complete, llamaindex_stream_chat, core_stream, core_stream_closed),
            strict=True,
        )
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the threads keep calling")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--hang-after", type=float, default=300.0, help="a call this long is a hang (s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from tokrag_integrations import load_model

    lm = load_model("default", device="cpu")
    calls = build_calls(lm, args.max_new_tokens)

    t0 = time.perf_counter()
    alone = {(kind, q): calls[kind](q, p, 0) for kind in KINDS for q, p in CASES}
    alone_s = time.perf_counter() - t0

    counts: Counter[str] = Counter()
    mismatches: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    started: list[float | None] = [None] * args.threads
    finished = [False] * args.threads
    deadline = time.monotonic() + args.seconds

    def worker(t: int) -> None:
        rng = random.Random(args.seed * 1000 + t)
        i = 0
        while time.monotonic() < deadline:
            kind = rng.choice(KINDS)
            q, p = rng.choice(CASES)
            started[t] = time.monotonic()
            try:
                got = calls[kind](q, p, i)
                with lock:
                    counts[kind] += 1
                    if got != alone[(kind, q)]:
                        mismatches.append(f"{kind} / {q!r}: {got!r} alone {alone[(kind, q)]!r}")
            except Exception as e:  # counted and shown; the soak goes on
                with lock:
                    counts[kind] += 1
                    errors.append(f"thread {t} ({kind}): {type(e).__name__}: {e}")
                traceback.print_exc()
            started[t] = None
            i += 1
        finished[t] = True

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(args.threads)]
    t1 = time.perf_counter()
    for th in threads:
        th.start()
    hung: set[int] = set()
    while not all(finished[t] or t in hung for t in range(args.threads)):
        time.sleep(0.2)
        for t in range(args.threads):
            s = started[t]
            if s is not None and time.monotonic() - s > args.hang_after:
                hung.add(t)
    soak_s = time.perf_counter() - t1

    total = sum(counts.values())
    print(
        f"calls {total} / errors {len(errors)} / hangs {len(hung)} / mismatches {len(mismatches)} "
        f"({args.threads} threads for {soak_s:.1f} s, {args.max_new_tokens} new tokens; the "
        f"{len(alone)} calls alone took {alone_s:.1f} s)"
    )
    print("  per kind: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
    for line in errors + mismatches:
        print("  " + line, file=sys.stderr)
    return 0 if not (errors or hung or mismatches) else 1


if __name__ == "__main__":
    sys.exit(main())
