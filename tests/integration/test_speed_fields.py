"""Every field of ``Speed`` takes effect on the call that sets it (issue 55, item 3).

Each test sets one field per call (``speed={...}``) on the packaged model and watches which
path ran: the prefill the decoder records (``fused`` / ``packed``), calls of the split
prefill, of the logit lens, of the routed kernels and of the packed head's product, the
stock-kernel switch seen inside the model's forward pass, and the kernel-plan files written.
The tokens are the same either way (a speed path changes the time only).
"""

from __future__ import annotations

import pytest
import torch

from tokrag_integrations import generate, generate_batch, load_model
from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel import packed as P
from tokrag_integrations.accel.sdpa import ATTN_IMPLEMENTATION
from tokrag_integrations.engine import view as V
from tokrag_integrations.speed import Speed

CONTRA = ("What is the capital of France?", ["The capital of France is Marseille."])
LONG = [
    "Quillfeather Aerospace was founded in 1987 by Mara Ellison in a former textile mill. " * 6,
    "The company builds small reusable sounding rockets for weather research. " * 6,
]


def test_every_field_is_a_speed_option():
    """The tests below cover every field (a new field needs its own test here)."""
    covered = {
        "fuse", "packed_prefill", "split_prefill", "share_lens", "cpu_kernels", "packed_head",
        "kernel_plan_cache", "static", "graphs",
    }
    assert {f for f in Speed.__dataclass_fields__} == covered


def test_static_and_graphs_per_call(lm, monkeypatch):
    """``static="on"``: the decode runs on the static state (``"auto"`` on a CPU does not);
    ``graphs="on"``: its step is the compiled one (a counting stand-in here: a real compile
    takes minutes on 2 cores), ``"off"``: the step function itself."""
    from tokrag_integrations.accel import static_step as SS

    compiled = []

    def stand_in(*a, **kw):
        compiled.append(1)
        return SS.static_step(*a, **kw)

    monkeypatch.setitem(SS._COMPILED, None, stand_in)
    runs = {
        name: generate(lm, *CONTRA, policy="rag", max_new_tokens=4, speed=speed)
        for name, speed in {
            "auto": None,
            "eager": {"static": "on", "graphs": "off"},
            "compiled": {"static": "on", "graphs": "on"},
        }.items()
    }
    assert "static" not in runs["auto"].trace.timings
    assert runs["eager"].trace.timings["static"] == runs["compiled"].trace.timings["static"] == 1.0
    assert len(compiled) == 4  # one compiled step per token of the "compiled" run only
    assert len({tuple(r.token_ids) for r in runs.values()}) == 1


def test_fuse_and_packed_prefill_per_call(lm):
    runs = {
        name: generate(lm, *CONTRA, policy="tokrag", max_new_tokens=8, speed=speed)
        for name, speed in {
            "default": None,
            "no_fuse": {"fuse": False},
            "no_pack": {"packed_prefill": False},
        }.items()
    }
    timings = {k: r.trace.timings for k, r in runs.items()}
    assert timings["default"]["fused"] == 1.0 and timings["default"]["packed"] == 1.0
    assert timings["no_fuse"]["fused"] == 0.0 and timings["no_fuse"]["packed"] == 0.0
    assert timings["no_pack"]["fused"] == 1.0 and timings["no_pack"]["packed"] == 0.0
    assert runs["no_fuse"].trace.speed["speed_paths_off"]["fused_contexts"] == "speed fuse=False"
    assert len({tuple(r.token_ids) for r in runs.values()}) == 1


def test_split_prefill_per_call(lm, monkeypatch):
    split = []
    real = P.split_prefill

    def counted(*a, **kw):
        out = real(*a, **kw)
        split.append(out is not None)
        return out

    monkeypatch.setattr(P, "split_prefill", counted)
    queries = ["Who founded Quillfeather?", "What does Quillfeather build?", "When was it founded?"]
    passages = [LONG] * len(queries)
    on = generate_batch(lm, queries, passages, policy="rag", max_new_tokens=4)
    assert split == [True]  # three ~400-token prompts: prefilled in groups, then merged
    split.clear()
    off = generate_batch(
        lm, queries, passages, policy="rag", max_new_tokens=4, speed={"split_prefill": False}
    )
    assert split == []
    assert [r.token_ids for r in on] == [r.token_ids for r in off]


def test_share_lens_per_call(lm, monkeypatch):
    calls = []
    real = V.logit_lens
    monkeypatch.setattr(V, "logit_lens", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # Two copies of one query: their lens rows are asked for at the same steps.
    queries, passages = [CONTRA[0]] * 2, [CONTRA[1]] * 2
    counts, tokens = {}, {}
    for share in (True, False):
        calls.clear()
        rs = generate_batch(
            lm, queries, passages, policy="tokrag", max_new_tokens=12, speed={"share_lens": share}
        )
        counts[share], tokens[share] = len(calls), [r.token_ids for r in rs]
    assert 0 < counts[True] < counts[False]
    assert tokens[True] == tokens[False]


def test_cpu_kernels_off_runs_the_stock_paths_for_that_call(lm, monkeypatch):
    seen: list[bool] = []
    layer = lm.model.model.layers[0]
    hook = layer.register_forward_pre_hook(lambda *a: seen.append(K.stock()))
    routed = []
    real = K._few_rows
    monkeypatch.setattr(K, "_few_rows", lambda *a: routed.append(1) or real(*a))
    try:
        stock = generate(lm, *CONTRA, policy="tokrag", max_new_tokens=8, speed={"cpu_kernels": "off"})
        assert seen and all(seen) and not routed
        assert stock.trace.timings["packed"] == 0.0  # packing is the tokrag_sdpa attention's
        assert stock.trace.speed["speed_paths_off"]["cpu_kernels"] == "speed cpu_kernels='off'"
        seen.clear()
        fast = generate(lm, *CONTRA, policy="tokrag", max_new_tokens=8)
        assert seen and not any(seen)
        assert bool(routed) == K.installed(lm.model)  # plans kept on this machine run
    finally:
        hook.remove()
    assert lm.model.config._attn_implementation == ATTN_IMPLEMENTATION  # still installed
    assert stock.token_ids == fast.token_ids


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_packed_head_per_call(lm, monkeypatch):
    products = []
    real = K.packed_product
    monkeypatch.setattr(K, "packed_product", lambda *a: products.append(1) or real(*a))
    counts, tokens = {}, {}
    for mode in ("on", "off"):
        products.clear()
        r = generate(lm, *CONTRA, policy="tokrag", max_new_tokens=16, speed={"packed_head": mode})
        counts[mode], tokens[mode] = len(products), r.token_ids
        assert any("l_star" in s.signals for s in r.trace.steps)  # the lens ran
    assert counts["on"] > 0 and counts["off"] == 0
    assert tokens["on"] == tokens["off"]


def test_kernels_are_installed_by_the_first_decode_that_uses_them(tmp_path, monkeypatch):
    """A fresh model is stock until its first decode; a decode with ``cpu_kernels`` off
    installs nothing; the next one installs the paths and measures the plans, keeping them on
    disk only where its ``kernel_plan_cache`` says so."""
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_PLANS", {})
    monkeypatch.setattr(K, "_time", lambda fn, reps, warm=True: 1.0)  # every strategy ties
    plans = tmp_path / "kernel_plans"
    lm = load_model("default", device="cpu")
    assert lm.model.config._attn_implementation == "sdpa"
    generate(lm, *CONTRA, policy="rag", max_new_tokens=2, speed={"cpu_kernels": "off"})
    assert lm.model.config._attn_implementation == "sdpa" and not plans.exists()
    generate(lm, *CONTRA, policy="rag", max_new_tokens=2, speed={"kernel_plan_cache": False})
    assert lm.model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert K._PLANS and not plans.exists()  # measured, not written
    monkeypatch.setattr(K, "_PLANS", {})
    again = load_model("default", device="cpu")
    generate(again, *CONTRA, policy="rag", max_new_tokens=2)
    assert plans.exists() and any(plans.glob("*.json"))
    stock = load_model("default", device="cpu", cpu_kernels="off")
    generate(stock, *CONTRA, policy="rag", max_new_tokens=2)
    assert stock.model.config._attn_implementation == "sdpa"  # loaded stock, stays stock
