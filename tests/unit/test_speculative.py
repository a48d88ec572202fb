"""Blockwise verification (issue 8): exactness against the step-by-step loop, cache rollback,
and the recorder, on the real default model.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_speculative.py``."""

from __future__ import annotations


def test_block_length_follows_the_cost_model():
    from tokrag_integrations.accel.speculative import MAX_BLOCK, MIN_BLOCK, best_block

    rates = [0.5, 0.2, 0.1, 0.05, 0.02, 0.005, 0.0]
    for beta in (0.0, 0.15, 0.5):
        ks = [best_block(r, beta) for r in rates]
        assert all(MIN_BLOCK <= k <= MAX_BLOCK for k in ks)
        assert (
            ks == sorted(ks) and ks[0] < ks[-1] == MAX_BLOCK
        )  # rarer verifier wins, longer blocks
    assert best_block(0.02, 0.5) < best_block(0.02, 0.0)  # a costlier verifier pass, shorter blocks
    assert best_block(0.3, 0.0) == 2
