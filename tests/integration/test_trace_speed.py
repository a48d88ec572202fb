"""Traces of equal decodes are equal whenever and wherever they run (issue 58).

The speed paths are measured on each machine: the kernel plans when a model is loaded (before
any decode of any process), the packed LM head lazily, at the first logit lens of enough rows.
So a process's first decode runs before that measurement and the later ones after it. What the
machine measured is the trace's ``speed`` (with its ``timings``), never its ``options``;
:meth:`Trace.comparable` leaves both out, and two decodes of one call, one before and one
after every measurement, compare equal."""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations import generate
from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel import packed_head as PH
from tokrag_integrations.accel.install import speed_paths

Q = "What is the name of the cat owned by Zorbin Quell?"
P = ["Zorbin Quell owns a grey cat named Pistachio.", "Cats sleep for most of the day."]


@pytest.fixture
def unmeasured_head(lm, monkeypatch):
    """The session model as a fresh process has it: its packed head not measured yet (no
    choice on the model, in the process or on disk), restored afterwards."""
    head = lm.model.get_output_embeddings()
    saved, choices = getattr(head, K._HEAD, None), dict(PH._HEAD_CHOICE)
    monkeypatch.setenv("TOKRAG_KERNEL_PLAN_CACHE", "0")  # no choice read from (or written to) disk
    monkeypatch.setenv("TOKRAG_PACKED_HEAD", "auto")
    if hasattr(head, K._HEAD):
        delattr(head, K._HEAD)
    PH._HEAD_CHOICE.clear()
    try:
        yield head
    finally:
        if hasattr(head, K._HEAD):
            delattr(head, K._HEAD)
        if saved is not None:
            setattr(head, K._HEAD, saved)
        PH._HEAD_CHOICE.clear()
        PH._HEAD_CHOICE.update(choices)


@pytest.mark.parametrize("ratio, head_state", [(2.0, "off: measured slower"), (0.5, "on (measured faster)")])
def test_a_decode_before_and_one_after_every_speed_measurement_compare_equal(
    lm, unmeasured_head, monkeypatch, ratio, head_state
):
    """The packed head's side-by-side timing is pinned to ``ratio``: this "machine" measures it
    slower (2.0, as the 2-core machine of issue 58 did) or faster (0.5) than the routed
    product, whatever the real one would."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build: the packed head is never measured")
    monkeypatch.setattr(K, "_alternating_ratio", lambda timed, rounds: ratio)
    assert speed_paths(lm.model)["packed_head"] == (
        f"on (measured at the first logit lens of >= {PH.HEAD_MIN_ROWS} rows)"
    )
    first = generate(lm, Q, P, max_new_tokens=12).trace
    PH.packed_head(unmeasured_head, "auto", cache=False)  # measured now, if the first decode's lens did not
    assert speed_paths(lm.model)["packed_head"].startswith(head_state)
    second = generate(lm, Q, P, max_new_tokens=12).trace

    assert first.steps and first.comparable() == second.comparable()
    assert any(s.disagreement for s in first.steps)  # the rule had something to decide
    # What the machine measured is the trace's speed, never its options.
    for t in (first, second):
        assert "speed_paths_off" not in t.options and "fuse" not in t.options
        assert t.speed["fuse"] is True
    off = second.speed["speed_paths_off"]
    assert ("packed_head" in off) == head_state.startswith("off"), off
    if "packed_head" in off:
        assert off["packed_head"] == "measured slower than the routed product on this machine"
