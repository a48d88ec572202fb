"""Soak one shared model with threads: abandoned and cancelled streams, generate, agenerate.

    OMP_NUM_THREADS=1 nice -n 5 python benchmarks/soak_threads.py
    python benchmarks/soak_threads.py --threads 8 --calls 20 --max-new-tokens 6

``--threads`` threads each make ``--calls`` calls on ONE model handle, cycling through four
kinds (each thread starts at a different one):

* **stream abandoned**: read one token, then keep the stream (so garbage collection cannot
  free it) and walk away; the stream's idle timeout (``--idle-timeout``) must free the model;
* **stream cancelled**: read one or two tokens, then ``close()`` the stream (every other time
  from another thread);
* **generate**: a whole answer;
* **agenerate**: a whole answer through asyncio (every other time cancelled after a first
  forward pass, which must stop the decode).

A call that raises is an error; a call still running after ``--hang-after`` seconds is a
hang. Afterwards a generate from a fresh thread must answer within its normal time (three
times a generate measured before the soak, plus the slack of ``--idle-timeout``). Prints
``calls done N / errors E / hangs H`` (expected: threads x calls / 0 / 0) and exits 1
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
import traceback
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUESTION = "Who founded Quillfeather Aerospace?"
PASSAGE = "Quillfeather Aerospace was founded in 2011 by Ottoline Varga in Tromsø."
KINDS = ("stream abandoned", "stream cancelled", "generate", "agenerate")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20, help="calls per thread")
    ap.add_argument("--max-new-tokens", type=int, default=6)
    ap.add_argument("--idle-timeout", type=float, default=0.5, help="abandoned streams' timeout (s)")
    ap.add_argument("--hang-after", type=float, default=300.0, help="a call this long is a hang (s)")
    args = ap.parse_args(argv)

    from tokrag_integrations import agenerate, generate, load_model, stream

    lm = load_model("default", device="cpu")
    kw: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}

    def one_generate() -> float:
        t0 = time.perf_counter()
        r = generate(lm, QUESTION, [PASSAGE], **kw)
        if not r.token_ids:
            raise RuntimeError("generate returned no token")
        return time.perf_counter() - t0

    one_generate()  # warm-up
    normal_s = one_generate()

    kept: list[Any] = []  # abandoned streams stay referenced until the end
    kept_lock = threading.Lock()

    def call(kind: str, i: int) -> None:
        policy = "tokrag" if i % 2 == 0 else "rag"
        if kind == "stream abandoned":
            s = stream(lm, QUESTION, [PASSAGE], policy=policy, idle_timeout=args.idle_timeout, **kw)
            next(s)
            with kept_lock:
                kept.append(s)
        elif kind == "stream cancelled":
            s = stream(lm, QUESTION, [PASSAGE], policy=policy, **kw)
            next(s)
            if i % 3 == 0:
                next(s, None)
            if i % 2:
                closer = threading.Thread(target=s.close)
                closer.start()
                closer.join()
            else:
                s.close()
            if next(s, None) is not None and i % 2 == 0:
                raise RuntimeError("a closed stream went on yielding")
        elif kind == "generate":
            r = generate(lm, QUESTION, [PASSAGE], policy=policy, **kw)
            if not r.token_ids:
                raise RuntimeError("generate returned no token")
        else:

            async def run() -> None:
                task = asyncio.create_task(agenerate(lm, QUESTION, [PASSAGE], policy=policy, **kw))
                if i % 2:
                    await asyncio.sleep(0.05)
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        return
                    return  # finished before the cancel arrived: fine too
                r = await task
                if not r.token_ids:
                    raise RuntimeError("agenerate returned no token")

            asyncio.run(run())

    done = [0] * args.threads
    errors: list[str] = []
    current: list[float | None] = [None] * args.threads
    finished = [False] * args.threads

    def worker(t: int) -> None:
        for i in range(args.calls):
            kind = KINDS[(t + i) % len(KINDS)]
            current[t] = time.monotonic()
            try:
                call(kind, i)
                done[t] += 1
            except Exception as e:
                errors.append(f"thread {t} call {i} ({kind}): {type(e).__name__}: {e}")
                traceback.print_exc()
            current[t] = None
        finished[t] = True

    t_start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(args.threads)]
    for th in threads:
        th.start()
    hung: set[int] = set()
    while not all(finished[t] or t in hung for t in range(args.threads)):
        time.sleep(0.2)
        now = time.monotonic()
        for t in range(args.threads):
            started = current[t]
            if started is not None and now - started > args.hang_after:
                hung.add(t)
    soak_s = time.perf_counter() - t_start

    final: dict[str, Any] = {}

    def final_call() -> None:
        final["s"] = one_generate()

    fresh = threading.Thread(target=final_call, daemon=True)
    fresh.start()
    limit = 3 * normal_s + args.idle_timeout + 1.0
    fresh.join(args.hang_after)
    final_ok = not fresh.is_alive() and final.get("s", float("inf")) <= limit
    if fresh.is_alive():
        hung.add(-1)

    total = sum(done)
    print(
        f"calls done {total} / errors {len(errors)} / hangs {len(hung)} "
        f"({args.threads} threads x {args.calls} calls in {soak_s:.1f} s; final generate from a "
        f"fresh thread {final.get('s', float('nan')):.2f} s, normal {normal_s:.2f} s)"
    )
    for e in errors:
        print("  error:", e, file=sys.stderr)
    expected = args.threads * args.calls
    return 0 if (total == expected and not errors and not hung and final_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
