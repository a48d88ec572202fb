"""The speed-path choices made by measurement (never slower than the plain path on the whole
model) and ``tokrag bench --throughput`` (arms interleaved, ratios per round).

This file holds the cases that need the real model, a database, a server or a subprocess; the others are in
``tests/unit/test_bench_choices.py``."""

from __future__ import annotations

import pytest

from tokrag_eval.cost import measure_throughput, run_bench
from tokrag_eval.hf_baseline import hf_generate
from tokrag_eval.report import bench_table
from tokrag_integrations import generate, load_model
from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel.install import speed_paths

from .test_stock_exactness import exactness_prompts


def test_the_real_model_never_keeps_a_bucket_measured_slower(lm):
    """On the packaged model, every bucket kept after the whole-model check was measured
    faster than the stock path there, and every other bucket routes to F.linear."""
    verdict = getattr(lm.model, K._VERDICT, None)
    if not K.installed(lm.model) and not verdict:
        pytest.skip("no few-row plan measured faster on this machine")
    assert verdict is not None
    mods = K._routed(lm.model)
    lo = 1
    for i, (_, hi) in enumerate(K.BUCKETS):
        label = f"rows {lo}-{hi}" if hi > lo else f"rows {lo}"
        v = verdict.get(label)
        if v is not None:
            assert v["kept"] == (v["ratio"] < K.VERIFY_GAIN)
        if v is None or not v["kept"]:
            assert all(getattr(m, K._PLAN)[r] is K._k_linear for m in mods for r in range(lo, hi + 1))
            assert all(getattr(m, K._PLAN_NAMES)[i] == "linear" for m in mods)
        lo = hi + 1
    # On or off as this machine measured it (issue 58: not the measuring machine's choice),
    # with the verdicts either way.
    on = any(v["kept"] for v in verdict.values())
    want = "on" if on else "off: no few-row plan installed"
    assert speed_paths(lm.model)["cpu_kernels"].startswith(f"{want} (model pass with plans / stock:")


def test_throughput_on_the_real_model(lm):
    # Short prompts: the test checks the measurement, not the speed.
    items = [
        ("What is the capital of France?", ["Paris is the capital of France."]),
        ("Who wrote Hamlet?", ["Hamlet was written by William Shakespeare."]),
    ]
    out = measure_throughput(lambda name: lm, items, (1, 2), 3, ("rag", "floor", "tokrag"), False, 1)
    for arm in ("rag", "floor", "tokrag"):
        for n in ("1", "2"):
            assert out["arms"][arm][n]["tokens_per_s"] > 0
            assert out["arms"][arm][n]["decode_tokens_per_s"] > 0
            assert out["arms"][arm][n]["questions_per_s"] > 0
    assert set(out["question_ratios"]) == {"floor / rag", "tokrag / rag"}


@pytest.fixture(scope="module")
def stock():
    """The packaged model without the package's CPU kernels: what the stock arms decode on."""
    return load_model("default", device="cpu", cpu_kernels="off")


def test_hugging_face_generate_gives_the_rag_arms_tokens(lm, stock):
    """The stock baseline decodes what ``rag`` decodes: Hugging Face ``generate``, greedy, on
    the RAG prompt's ids (the pure prompt where no passage is usable), gives ``rag``'s tokens
    on CPU in float32, with the dynamic and the static cache, alone and left-padded in a batch."""
    prompts = [exactness_prompts()[i] for i in (0, 1, 3, 4)]
    assert any(not ps for _, ps in prompts)  # one answers from the pure prompt
    n = 16
    want = [generate(lm, q, ps, policy="rag", max_new_tokens=n).token_ids for q, ps in prompts]
    assert any(len(w) < n for w in want)  # an answer that ends at EOS
    assert any(len(w) == n for w in want)  # and one that runs to max_new_tokens
    for cache in ("dynamic", "static"):
        got = [
            hf_generate(stock, [q], [ps], max_new_tokens=n, cache=cache, compile=False).answers[0]
            for q, ps in prompts
        ]
        assert got == want, cache
    run = hf_generate(stock, [q for q, _ in prompts], [ps for _, ps in prompts], max_new_tokens=n)
    assert run.answers == want
    assert 0 < run.prefill_s < run.seconds
    with pytest.raises(ValueError, match="cache must be"):
        hf_generate(stock, ["q"], [["p"]], max_new_tokens=2, cache="paged")


def test_bench_times_hugging_face_generate_beside_rag():
    items = [exactness_prompts()[i] for i in (0, 3)]
    res = run_bench(
        items=items, policies=("rag", "hf-generate"), max_new_tokens=6, memory=False,
        progress=False, passages=len(items[1][1]),
    )
    assert res["same_tokens_as_rag"] == {"hf-generate": {"questions": 2, "identical": 2}}
    hf = res["policies"]["hf-generate"]
    assert hf["tokens_per_question"] == res["policies"]["rag"]["tokens_per_question"]
    assert 0 < hf["prefill_s_per_question"] < hf["s_per_question"]
    table = bench_table(res)
    assert "| rag / hf-generate |" in table
    assert "hf-generate = rag, tokens: 2 / 2 questions" in table
