"""Admission of the scheduler's step loop (``scheduler._Loop``) with stand-ins for
the model, the policy and the running decoder: first come first served, the row and
position bounds, and an empty decode taking any call. The decoding itself is tested on the
packaged model (tests/integration/test_batch_rows.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokrag_integrations.engine.scheduler import MicroBatcher, _Loop, _Request


class _Policy:
    def prepare(self, lm):
        pass

    def contexts(self, plan):
        return {role: SimpleNamespace(ids=[0] * n) for role, n in plan.lengths.items()}


class _BadPolicy(_Policy):
    def contexts(self, plan):
        raise ValueError("prompt too long")


def _prepared(**lengths):
    return SimpleNamespace(
        groups={"main": [0]}, policies={"main": _Policy()}, plans=[SimpleNamespace(lengths=lengths)]
    )


class _FakeDecoder:
    def __init__(self, rows, width):
        self._rows, self._width, self.active = rows, width, [0]

    def rows_in_use(self):
        return self._rows

    def width(self):
        return self._width


def _fits(cont, /, **lengths):
    return cont._fits(cont._need(_prepared(**lengths)))


def _continuous(
    max_rows=32, max_positions=None, rows=0, width=0, max_new_tokens=10, max_prefill_tokens=None
):
    b = MicroBatcher(
        object(),
        max_rows=max_rows,
        max_positions=max_positions,
        max_prefill_tokens=max_prefill_tokens,
    )
    c = _Loop(object(), max_new_tokens, b)
    if rows:
        c.decoders["main"] = _FakeDecoder(rows, width)
    return c


def test_an_empty_decode_takes_any_call():
    c = _continuous(max_rows=1, max_positions=1)
    assert _fits(c, pure=50, rag=900)


def test_rows_bound():
    c = _continuous(max_rows=32, rows=30, width=100)
    assert _fits(c, pure=10, rag=90)  # 30 + 2 rows
    assert not _fits(c, a=1, b=1, c=1)  # 30 + 3 rows


def test_positions_bound_counts_the_longest_row_and_the_answer_budget():
    # 2 running rows of 100 positions + a call of two contexts, the longer 300:
    # 4 rows x (300 + 10 new tokens) = 1240 positions.
    assert _fits(_continuous(max_positions=1240, rows=2, width=100), pure=20, rag=300)
    assert not _fits(_continuous(max_positions=1239, rows=2, width=100), pure=20, rag=300)
    # the running rows' width counts when it is the longest
    assert not _fits(_continuous(max_positions=1239, rows=2, width=300), pure=20, rag=30)


def test_calls_are_admitted_first_come_first_served(monkeypatch):
    c = _continuous(max_rows=4, rows=2, width=10)
    big, small = _Request(_prepared(a=1, b=1, c=1)), _Request(_prepared(a=1))
    big.need, small.need = c._need(big.prepared), c._need(small.prepared)
    c.queue = [big, small]
    started = []
    monkeypatch.setattr(c, "_start", started.append)
    c._admit()
    assert started == [] and c.queue == [big, small]  # small does not overtake big
    c.decoders.clear()  # the running decode finished
    c._admit()
    assert started == [big, small] and c.queue == []


def test_a_bad_call_gets_its_error_and_the_next_one_is_admitted(monkeypatch):
    c = _continuous()
    bad, good = _Request(_prepared(a=1)), _Request(_prepared(a=1))
    bad.prepared.policies = {"main": _BadPolicy()}
    c.queue = [bad, good]
    started = []
    monkeypatch.setattr(c, "_start", started.append)
    c._admit()
    assert isinstance(bad.error, ValueError) and bad.done.is_set()
    assert started == [good]


def test_a_burst_is_admitted_a_prefill_budget_per_step(monkeypatch):
    """With a budget of 2048 prompt tokens a boundary, calls of 1000 tokens join two at a
    time, in order; the first call of a boundary is admitted even when it alone is over."""
    c = _continuous(max_prefill_tokens=2048)
    reqs = [_Request(_prepared(pure=100, rag=900)) for _ in range(4)]
    reqs.append(_Request(_prepared(pure=300, rag=3000)))
    c.queue = list(reqs)
    started = []
    monkeypatch.setattr(c, "_start", started.append)
    c._admit()
    assert started == reqs[:2] and c.queue == reqs[2:]
    c._admit()
    assert started == reqs[:4]
    c._admit()
    assert started[-1] is reqs[4] and c.queue == []


def test_no_prefill_budget_admits_every_call_that_fits(monkeypatch):
    c = _continuous(max_prefill_tokens=None)
    reqs = [_Request(_prepared(pure=100, rag=900)) for _ in range(4)]
    c.queue = list(reqs)
    started = []
    monkeypatch.setattr(c, "_start", started.append)
    c._admit()
    assert started == reqs


@pytest.mark.parametrize("kw", [{"max_rows": 0}, {"max_positions": 0}, {"max_prefill_tokens": 0}])
def test_bounds_must_be_positive(kw):
    with pytest.raises(ValueError, match="must be >= 1"):
        MicroBatcher(object(), **kw)


def test_without_continuous_batching_calls_wait_for_an_empty_decode(monkeypatch):
    """``continuous=False``: nothing joins a running decode; an empty one takes the queued
    calls, ``max_batch`` at a time, in order."""
    b = MicroBatcher(object(), max_batch=2, continuous=False)
    c = _Loop(object(), 10, b)
    reqs = [_Request(_prepared(pure=10, rag=90)) for _ in range(3)]
    c.queue = list(reqs)
    c.decoders["main"] = _FakeDecoder(2, 100)  # a running decode
    started = []
    monkeypatch.setattr(c, "_start", started.append)
    c._admit()
    assert started == [] and c.queue == reqs
    c.decoders.clear()
    c._admit()
    assert started == reqs[:2] and c.queue == reqs[2:]
