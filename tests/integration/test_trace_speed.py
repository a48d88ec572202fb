"""Traces of equal decodes are equal whenever and wherever they run (issue 58).

The speed paths are measured on each machine, some of them lazily: the packed LM head at the
first logit lens of enough rows, so the first decode of a process runs before that
measurement and the later ones after it. What the machine measured is the trace's ``speed``
(with ``timings``), never its ``options``; :meth:`Trace.comparable` leaves both out, and two
decodes of one call, one before and one after every measurement, compare equal."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tokrag_integrations.trace import Trace

#: Run in a fresh process whose cache folder (:func:`_fresh_cache`) holds the kernel plans
#: but no verdict and no head choice: the whole-model check of the plans runs at the load,
#: the packed head is measured at the first logit lens of enough rows (or when called). Every
#: side-by-side timing is pinned to the ratio given, so the "machine" measures the plans and
#: the packed head faster (0.5) or slower (2.0) whatever the real one would.
SCRIPT = r"""
import json, sys
from tokrag_integrations.accel import cpu_kernels

ratio = float(sys.argv[1])
cpu_kernels._alternating_ratio = lambda timed, rounds: ratio

from tokrag_integrations import generate, load_model
from tokrag_integrations.accel.install import speed_paths

q = "What is the name of the cat owned by Zorbin Quell?"
p = ["Zorbin Quell owns a grey cat named Pistachio.", "Cats sleep for most of the day."]
lm = load_model("default", device="cpu")
before = speed_paths(lm.model)
first = generate(lm, q, p, max_new_tokens=12)
cpu_kernels.packed_head(lm.model.get_output_embeddings())  # measured now, if not yet
after = speed_paths(lm.model)
second = generate(lm, q, p, max_new_tokens=12)
print(json.dumps({"before": before, "after": after,
                  "traces": [first.trace.to_dict(), second.trace.to_dict()]}))
"""


@pytest.fixture
def _fresh_cache(lm, tmp_path):
    """A cache folder for one fresh process: the session's converted models and its kernel
    plans (pinned: read, not measured again; the session's load has stored them), without the
    plans' whole-model verdicts and the packed head's choices (measured afresh, and kept in
    this folder only)."""
    from tokrag_integrations.accel.cpu_kernels import _plan_file
    from tokrag_integrations.config import cache_dir

    root = tmp_path / "cache"
    root.mkdir()
    (root / "models").symlink_to(cache_dir() / "models", target_is_directory=True)
    plans = _plan_file()
    if plans is not None and plans.is_file():
        (root / "kernel_plans").mkdir()
        shutil.copy(plans, root / "kernel_plans" / plans.name)
    return root


@pytest.mark.parametrize("ratio, head", [(2.0, "off: measured slower"), (0.5, "on (measured faster)")])
def test_a_decode_before_and_one_after_every_speed_measurement_compare_equal(ratio, head, _fresh_cache):
    env = dict(os.environ, TOKRAG_CACHE_DIR=str(_fresh_cache), TOKRAG_KERNEL_PLAN_CACHE="1",
               TOKRAG_PACKED_HEAD="auto", TOKRAG_CPU_KERNELS="auto")  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ratio)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # The first decode ran before the packed head was measured, the second after.
    assert out["before"]["packed_head"] == "on (measured at the first logit lens of >= 6 rows)"
    assert out["after"]["packed_head"].startswith(head), out["after"]
    first, second = (Trace.from_dict(t) for t in out["traces"])
    assert first.steps and first.comparable() == second.comparable()
    assert [(s.token_id, s.source) for s in first.steps] == [
        (s.token_id, s.source) for s in second.steps
    ]
    assert any(s.disagreement for s in first.steps)  # the rule had something to decide
    # What the machine measured is the trace's speed, never its options.
    for t in (first, second):
        assert "speed_paths_off" not in t.options and "fuse" not in t.options
        assert t.speed["fuse"] is True
    off = second.speed["speed_paths_off"]
    if head.startswith("off"):
        assert off["packed_head"].startswith("measured slower"), off
        assert off["cpu_kernels"].startswith("no few-row plan installed"), off  # 2.0x: stock
    else:
        assert "packed_head" not in off and "cpu_kernels" not in off, off
