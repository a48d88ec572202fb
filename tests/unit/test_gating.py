"""Retrieval gating: metric formulas, thresholds, calibration files, GECE, CtrlA, routers.

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_gating.py``."""

from __future__ import annotations

import math

import pytest
import torch
from _helpers import require

from tokrag_integrations.engine.stats import distribution_stats
from tokrag_integrations.gating import Gate, GECEGate
from tokrag_integrations.gating.confidence import metrics_from_probs, metrics_from_stats
from tokrag_integrations.gating.gece import CountSketch, meteor


def test_metrics_on_hand_made_distributions():
    # two steps over V = 4: one-hot-ish and uniform
    probs = torch.tensor([[0.5, 0.5, 0.0 + 1e-300, 0.0 + 1e-300], [0.25, 0.25, 0.25, 0.25]])
    m = metrics_from_probs(probs, [0, 3])
    assert m.raw["avg_logp"] == pytest.approx((math.log(0.5) + math.log(0.25)) / 2)
    assert m.raw["gini"] == pytest.approx((0.5 + 0.25) / 2)
    assert m.raw["entropy"] == pytest.approx((math.log(2) + math.log(4)) / 2)
    assert m.raw["dp"] == pytest.approx((2 + 4) / 2)
    # uniform step contributes 0 to Self-Certainty; confidence flips entropy and DP
    assert m.confidence["entropy"] == -m.raw["entropy"]
    assert m.confidence["dp"] == -m.raw["dp"]
    u = metrics_from_probs(torch.full((1, 8), 1 / 8), [2])
    assert u.raw["self_certainty"] == pytest.approx(0.0)


def test_decoder_stats_give_the_same_metrics_as_full_distributions():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 3
    ids = [3, 7, 0, 49, 12]
    steps = [{"stats": {"pure": distribution_stats(logits[i], ids[i])}} for i in range(5)]
    a = metrics_from_stats(steps, 50)
    b = metrics_from_probs(torch.softmax(logits.double(), -1), ids)
    for k in b.raw:
        assert a.raw[k] == pytest.approx(b.raw[k], rel=1e-5, abs=1e-6), k
    assert a.mean_prob == pytest.approx(b.mean_prob, rel=1e-5)


class _TableGate(Gate):
    name = "table"
    retrieve_when = "below"

    def __init__(self, table=None, **kw):
        super().__init__()
        self.table = table or {}

    def score(self, query):
        return self.table[query], {}


def test_decisions_flip_across_calibrated_threshold_and_round_trip(tmp_path):
    table = {f"q{i}": float(i) for i in range(11)}
    g = _TableGate(table)
    with pytest.raises(RuntimeError, match="calibrate"):
        g.decide("q1")
    g.calibrate(list(table), percentile=70)  # 70 % answered without retrieval
    assert g.threshold == pytest.approx(3.0)
    assert g.decide("q2").retrieve and not g.decide("q4").retrieve
    assert sum(g.decide(q).retrieve for q in table) == 3
    path = g.save(tmp_path / "gate.json")
    h = _TableGate.load(path, table=table)
    assert h.threshold == g.threshold and h.percentile == 70
    assert [h.decide(q).retrieve for q in table] == [g.decide(q).retrieve for q in table]
    d = h.decide("q0").to_dict()
    assert d["retrieve"] is True and d["score"] == 0.0 and d["threshold"] == 3.0


def test_meteor_exact_and_stem_stages():
    assert meteor("the cat sat", "the cat sat") == pytest.approx(1 - 0.5 * (1 / 3) ** 3)
    # "cats" matches "cat" at the stem stage; 2 of 3 unigrams match in one chunk
    p, r = 2 / 2, 2 / 3
    f = p * r / (0.9 * p + 0.1 * r)
    assert meteor("black cats", "the black cat") == pytest.approx(f * (1 - 0.5 * (1 / 2) ** 3))
    assert meteor("dog", "cat") == 0.0


def test_gece_gold_mode_matches_hand_computation():
    g = GECEGate.__new__(GECEGate)
    g.mode = "gold"
    g.mean_grad = torch.tensor([1.0, 2.0, 0.0])
    terms = {
        "pred": "Paris",
        "refs": ["Paris"],
        "meteor": meteor("Paris", "Paris"),
        "mean_p": 0.25,
        "alpha": 0.01,
        "grad": torch.tensor([0.5, 0.5, 3.0]),
    }
    val, det = g.gece(terms)
    m = 1 - 0.5  # one word, one chunk: penalty 0.5
    assert det["meteor"] == pytest.approx(m)
    assert val == pytest.approx(abs(m - 0.25) / (0.01 * (0.5 + 1.0)))
    # a non-positive dot product is floored (most long-tail), never flips the sign
    terms["grad"] = torch.tensor([-1.0, 0.0, 0.0])
    assert g.gece(terms)[0] == pytest.approx(abs(m - 0.25) / (0.01 * 1e-3 * 5.0))


def test_count_sketch_preserves_dot_products():
    torch.manual_seed(1)
    a = [torch.randn(200, 300), torch.randn(5000)]
    b = [0.6 * a[0] + 0.8 * torch.randn(200, 300), 0.6 * a[1] + 0.8 * torch.randn(5000)]
    exact = sum(float((x * y).sum()) for x, y in zip(a, b, strict=True))
    sk = CountSketch([x.numel() for x in a], 16384, seed=0)
    approx = float(torch.dot(sk(a).double(), sk(b).double()))
    assert approx == pytest.approx(exact, rel=0.1)


def test_gated_query_engine_keeps_the_callers_callback_manager() -> None:
    require("llama_index.core", "llama-index-core")
    from llama_index.core import Settings
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

    from tokrag_integrations.llama_index.gated_engine import gated_query_engine

    mine = CallbackManager([TokenCountingHandler()])
    assert gated_query_engine(None, None, None, callback_manager=mine).callback_manager is mine
    assert gated_query_engine(None, None, None).callback_manager is Settings.callback_manager
