"""Hostile and careless use of one shared model (issue 18, points 1, 6 and 7).

Point 1: one model handle shared by threads and asyncio tasks; a stream that is held, closed,
dropped in another thread, read from two threads, and cancelled ``agenerate``/``astream`` calls
must all leave the model usable. Every wait has a timeout, so a regression fails instead of
hanging. Points 6 and 7: wrong inputs are refused up front with one-sentence errors.

Cases that need no model, database or server are in ``tests/unit/test_hostile_model.py``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _helpers import CheckedThread, join_all

from tokrag_integrations import Passage, agenerate, astream, generate, generate_batch, stream
from tokrag_integrations.engine.streams import StreamAbandoned

#: A question SmolLM2 answers at length (it runs to any max_new_tokens up to 200).
LONG_Q = "List the numbers from 1 to 100, one per line."
SHORT_Q = "Who founded Quillfeather Aerospace?"
PASSAGE = "Quillfeather Aerospace was founded in 2011 by Ottoline Varga in Tromsø."
#: Generous bound for one short decode on a busy 2-core machine (never a performance check:
#: only a model that stays locked runs into it).
WAIT_S = float(os.environ.get("TOKRAG_TEST_WAIT_S", "120"))


def _in_thread(fn: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    """Run ``fn`` in a fresh daemon thread and return its value; its exception is re-raised
    here, and it fails (not hangs) when it does not finish in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        box["value"] = fn()

    t = CheckedThread(target=run, name=getattr(fn, "__name__", "call"), daemon=True)
    t.start()
    t.join(timeout)
    return box.get("value")


def _model_is_free(lm: Any) -> bool:
    """Whether another thread could take the model lock right now."""

    def probe() -> bool:
        if lm.lock.acquire(timeout=5):
            lm.lock.release()
            return True
        return False

    return bool(_in_thread(probe, timeout=30))


def _short_generate(lm: Any) -> Callable[[], str]:
    def short_generate() -> str:
        return generate(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=3).text

    return short_generate


@contextlib.contextmanager
def _counting_forwards(lm: Any) -> Iterator[list[int]]:
    """Counts forward passes (every decode path embeds its input ids once per pass)."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    handle = lm.model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


# ============================================================================ point 1
def test_unread_stream_is_abandoned_after_its_idle_timeout(lm):
    s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20, idle_timeout=0.5)
    next(s)  # the stream now holds the model, and its reader walks away (keeping it)
    assert _in_thread(_short_generate(lm))
    with pytest.raises(StreamAbandoned, match="not read for 0.5 s"):
        next(s)
    with pytest.raises(StreamAbandoned):
        next(s)
    assert _model_is_free(lm)


def test_idle_timeout_comes_from_the_environment(lm, monkeypatch):
    monkeypatch.setenv("TOKRAG_STREAM_IDLE_TIMEOUT", "0.5")
    s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20)
    next(s)
    assert _in_thread(_short_generate(lm))
    with pytest.raises(StreamAbandoned):
        next(s)
    monkeypatch.setenv("TOKRAG_STREAM_IDLE_TIMEOUT", "5s")
    with pytest.raises(ValueError, match=r"TOKRAG_STREAM_IDLE_TIMEOUT must be a number of seconds, got '5s'"):
        stream(lm, SHORT_Q)
    with pytest.raises(ValueError, match="idle_timeout must be a number of seconds > 0"):
        stream(lm, SHORT_Q, idle_timeout=0)


def test_closed_stream_frees_the_model_from_any_thread(lm):
    s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20, idle_timeout=600)
    next(s)
    _in_thread(s.close)  # closed by another thread than the one that read it
    assert _in_thread(_short_generate(lm))
    with pytest.raises(StopIteration):
        next(s)
    with pytest.raises(RuntimeError, match="closed before its end"):
        s.result  # noqa: B018
    with stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20, idle_timeout=600) as s2:
        next(s2)
    assert _model_is_free(lm)


def test_stream_dropped_in_another_thread_frees_the_model(lm):
    held: list[Any] = []

    def start() -> None:
        s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20, idle_timeout=600)
        next(s)
        held.append(s)

    _in_thread(start)
    held.clear()  # the last reference goes away in this thread
    gc.collect()
    assert _in_thread(_short_generate(lm))
    assert _model_is_free(lm)


def test_reading_a_stream_while_holding_the_model_lock_is_an_error_not_a_deadlock(lm):
    s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=4)
    with lm.lock:
        with pytest.raises(RuntimeError, match="this thread holds lm.lock"):
            next(s)
        assert generate(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=2).token_ids
    assert len(list(s)) >= 1
    assert _model_is_free(lm)


def test_stream_started_in_one_thread_finishes_in_another(lm):
    expected = generate(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=12)
    s = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=12, idle_timeout=600)
    first = _in_thread(lambda: next(s))
    rest = _in_thread(lambda: list(s))
    assert "".join(ev.text for ev in [first, *rest]) == expected.text
    assert s.result.token_ids == expected.token_ids
    assert _model_is_free(lm)


def test_two_threads_advance_one_stream(lm):
    expected = generate(lm, SHORT_Q, [PASSAGE], max_new_tokens=16)  # tokrag, the default
    s = stream(lm, SHORT_Q, [PASSAGE], max_new_tokens=16, idle_timeout=600)
    got: list[Any] = []
    start = threading.Barrier(2)

    def reader() -> None:
        start.wait()
        for ev in s:
            got.append(ev)

    threads = [CheckedThread(target=reader, name=f"reader {i}", daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    join_all(threads, WAIT_S)  # a reader that hung or raised fails the test
    ordered = sorted(got, key=lambda ev: ev.index)
    assert len({ev.index for ev in got}) == len(got)  # each event went to exactly one reader
    assert "".join(ev.text for ev in ordered) == expected.text
    assert s.result.token_ids == expected.token_ids
    assert _in_thread(_short_generate(lm))  # a fresh thread still gets the model


def test_cancelled_agenerate_stops_decoding(lm):
    async def scenario(calls: list[int]) -> int:
        task = asyncio.create_task(agenerate(lm, LONG_Q, policy="no_rag", max_new_tokens=200))
        for _ in range(int(WAIT_S * 20)):
            if calls[0] >= 3:
                break
            await asyncio.sleep(0.05)
        assert calls[0] >= 3, "the decode never started"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        stopped_at = calls[0]
        await asyncio.sleep(0.5)
        assert calls[0] == stopped_at, "the cancelled decode went on in its worker thread"
        return stopped_at

    with _counting_forwards(lm) as calls:
        stopped_at = asyncio.run(scenario(calls))
    assert stopped_at < 200
    assert _model_is_free(lm)


def test_cancelled_astream_stops_decoding(lm):
    async def scenario(calls: list[int]) -> tuple[int, int]:
        seen: list[Any] = []
        two = asyncio.Event()

        async def consume() -> None:
            async for ev in astream(lm, LONG_Q, [PASSAGE], max_new_tokens=200, idle_timeout=600):
                seen.append(ev)
                if len(seen) == 2:
                    two.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(two.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        stopped_at = calls[0]
        await asyncio.sleep(0.5)
        return stopped_at, calls[0]

    with _counting_forwards(lm) as calls:
        stopped_at, later = asyncio.run(scenario(calls))
    assert later == stopped_at, "the cancelled stream went on decoding"
    assert stopped_at < 200
    assert _model_is_free(lm)


def test_agenerate_cancelled_while_waiting_for_the_model_never_decodes(lm):
    async def scenario(calls: list[int]) -> int:
        holder = stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=20, idle_timeout=600)
        await asyncio.to_thread(next, holder)  # the model is now taken by this stream
        before = calls[0]
        task = asyncio.create_task(agenerate(lm, LONG_Q, policy="no_rag", max_new_tokens=200))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        holder.close()
        await asyncio.to_thread(holder._worker.join, WAIT_S)
        await asyncio.sleep(0.5)
        return calls[0] - before

    with _counting_forwards(lm) as calls:
        extra = asyncio.run(scenario(calls))
    assert extra <= 1  # at most the holder's own look-ahead step, never the cancelled call
    assert _model_is_free(lm)


# ============================================================================ point 6
def test_generate_batch_refuses_a_string_of_queries(lm):
    with pytest.raises(TypeError, match="queries must be a list of strings, got a str"):
        generate_batch(lm, "Who?")
    with pytest.raises(TypeError, match="one list of passages per query"):
        generate_batch(lm, ["Who?"], "a passage")


def test_a_single_string_of_passages_is_refused(lm):
    with pytest.raises(TypeError, match="passages must be a list of passages, not a single str"):
        generate(lm, SHORT_Q, PASSAGE, policy="rag", max_new_tokens=2)
    with pytest.raises(TypeError, match="query must be a string, got int"):
        generate(lm, 42, [PASSAGE], policy="rag", max_new_tokens=2)
    with pytest.raises(TypeError, match="stop must be a string or a list of strings, got 5"):
        generate(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=2, stop=5)


@pytest.mark.parametrize("bad", [2.5, 0, -1, True, "3", None])
def test_max_new_tokens_is_checked_before_the_prefill(lm, bad):
    with _counting_forwards(lm) as calls:
        with pytest.raises(ValueError, match=r"^max_new_tokens must be a whole number >= 1, got "):
            generate(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=bad)
        with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
            stream(lm, SHORT_Q, [PASSAGE], policy="rag", max_new_tokens=bad)
    assert calls[0] == 0


def test_lone_surrogates_are_replaced_with_a_warning(lm):
    with pytest.warns(UserWarning, match="lone surrogate"):
        p = Passage("Quillfeather\ud800 Aerospace was founded by Ottoline Varga.")
    assert p.text == "Quillfeather\ufffd Aerospace was founded by Ottoline Varga."
    with pytest.warns(UserWarning, match="query contains 1 lone surrogate"), pytest.warns(
        UserWarning, match="a passage contains 1 lone surrogate"
    ):
        r = generate(lm, "Who founded \udcffQuillfeather?", [PASSAGE + "\udc80"], policy="rag", max_new_tokens=3)
    assert r.trace.query == "Who founded \ufffdQuillfeather?"
    assert r.trace.passages[0].text.endswith("\ufffd")
    assert r.token_ids
