"""The contract's lens rounds (:func:`tokrag_integrations.policies.base.lens_rounds`): the
rows every query still asks for go to the engine's lens in one call per round, and each
query gets back the values of its own rows."""

from __future__ import annotations

import torch

from tokrag_integrations.policies.base import lens_rounds


def _asks(n_rounds: int, width: int, tag: float):
    """A query's signals: ``n_rounds`` requests of ``width`` rows; returns what it was sent."""
    got = []
    for r in range(n_rounds):
        got.append((yield torch.full((width, 2), tag + r)))
    return {"got": got}


def test_one_lens_call_per_round_for_every_query_still_asking():
    calls = []

    def lens(blocks, final_norm=True):
        calls.append(([b.shape[0] for b in blocks], final_norm))
        return [b * 10 for b in blocks]  # each block's own values, in order

    out = lens_rounds([_asks(1, 2, 1.0), _asks(3, 1, 5.0), _asks(0, 1, 9.0)], lens, False)
    assert calls == [([2, 1], False), ([1], False), ([1], False)]
    assert torch.equal(out[0]["got"][0], torch.full((2, 2), 10.0))
    assert [float(g[0, 0]) for g in out[1]["got"]] == [50.0, 60.0, 70.0]
    assert out[2] == {"got": []}  # asked for nothing: no lens call on its behalf
    assert lens_rounds([], lens, True) == [] and len(calls) == 3
