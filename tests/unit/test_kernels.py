"""The decode-speed machinery of issue 8: CPU few-row kernels, the in-place KV cache and the
fused pure+RAG batch. Each must compute what the stock path computes (to rounding).

This file holds the cases that need no model, database or server; the others are in
``tests/integration/test_kernels.py``."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel import packed_head as PH
from tokrag_integrations.accel.cpu_kernels import few_row_linear, install, installed, uninstall
from tokrag_integrations.accel.sdpa import few_query_attention
from tokrag_integrations.contexts.kv_cache import GrowableLayer


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 64, 65, 200])
@pytest.mark.parametrize("out_features", [192, 1536, 4100])
@pytest.mark.parametrize("strategy", K.STRATEGIES)
def test_few_row_strategies_equal_linear(rows, out_features, strategy):
    torch.manual_seed(rows)
    w = torch.randn(out_features, 576)
    b = torch.randn(out_features)
    x = torch.randn(1, rows, 576)
    for bias in (None, b):
        got = few_row_linear(x, w, bias, strategy)
        want = F.linear(x, w, bias)
        assert got.shape == want.shape and got.is_contiguous()
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
    # A column-major input (what an elementwise op on a transposed output gives) too.
    xt = torch.randn(576, rows).t()[None]
    assert torch.allclose(
        few_row_linear(xt, w, None, strategy), F.linear(xt, w), atol=1e-4, rtol=1e-5
    )
    assert torch.allclose(few_row_linear(xt, w, None, "wxt"), F.linear(xt, w), atol=1e-4, rtol=1e-5)


def test_tiled_strategy_keeps_gradients():
    w = torch.randn(4100, 8, requires_grad=True)
    x = torch.randn(3, 8)
    K.KERNELS["tiled"](x, w, None).sum().backward()
    assert w.grad is not None and torch.allclose(w.grad, x.sum(0).expand_as(w))


def test_plans_are_measured_per_shape_and_routed_by_row_count(monkeypatch):
    w = torch.randn(4096, 64)
    monkeypatch.setattr(K, "_PLANS", {})  # the model's measured plans stay as they were
    calls = []
    real = K._time
    monkeypatch.setattr(K, "_time", lambda fn, reps, **kw: calls.append(reps) or real(fn, 1, **kw))
    plan = K.plan_for(w, cache=False)  # measured here, not read from disk
    assert len(plan) == len(K.BUCKETS) and set(plan) <= set(K.STRATEGIES)
    assert "dup" not in plan[1:]  # duplication is a one-row strategy
    n_calls = len(calls)
    assert K.plan_for(w, cache=False) is plan and len(calls) == n_calls  # cached for the process
    table = K._route(("dup", "linear", "wxt", "tiled", "pad", "linear", "wxt"))
    assert len(table) == K.MAX_ROWS + 1
    assert table[1] is K._k_dup and table[2] is K._k_linear
    assert table[3] is table[4] is K._k_wxt and table[5] is table[8] is K._k_tiled
    # ``pad`` rounds the bucket (9-16) up to its top row count.
    assert table[9] is table[16] and table[9].keywords == {"rows": 16}
    assert table[17] is table[32] is K._k_linear and table[33] is table[K.MAX_ROWS] is K._k_wxt
    # A module routed by a plan computes what F.linear does at every row count.
    lin = torch.nn.Linear(64, 4096, bias=True)
    model = torch.nn.Sequential(lin)
    K._PLANS[(4096, 64, torch.float32, torch.get_num_threads())] = (
        "dup",
        "wxt",
        "tiled",
        "pad",
        "pad",
        "wxt",
        "linear",
    )
    assert install(model, "auto") == 1 and installed(model)
    with torch.inference_mode():
        for m in (1, 2, 3, 5, 8, 11, 16, 30, 40, 70):
            x = torch.randn(m, 64)
            assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-4)
    uninstall(model)
    # A shape where F.linear wins everywhere keeps the stock forward.
    K._PLANS[(4096, 64, torch.float32, torch.get_num_threads())] = ("linear",) * len(K.BUCKETS)
    assert install(model, "auto") == 0 and not installed(model)


def test_plans_persist_per_machine_on_disk(monkeypatch, tmp_path):
    """A measured plan is written to the cache folder and read back by a later process
    (simulated by clearing the in-process plans) without timing anything; a damaged file
    or ``Speed.kernel_plan_cache`` off means measuring again."""
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(K, "_PLANS", {})
    w = torch.randn(1024, 32)
    timed = []
    real = K._time
    monkeypatch.setattr(K, "_time", lambda fn, reps, **kw: timed.append(1) or real(fn, reps, **kw))
    plan = K.plan_for(w)
    path = K._plan_file()
    assert path is not None and path.parent == tmp_path / "kernel_plans" and path.exists()
    assert timed
    stored = json.loads(path.read_text())
    assert stored == {f"1024x32:float32:{torch.get_num_threads()}": list(plan)}

    def no_timing(fn, reps, **kw):
        raise AssertionError("a stored plan must not be measured again")

    monkeypatch.setattr(K, "_time", no_timing)
    monkeypatch.setattr(K, "_PLANS", {})
    assert K.plan_for(w) == plan
    # Another shape is added to the same file.
    monkeypatch.setattr(K, "_time", lambda fn, reps, **kw: real(fn, reps, **kw))
    K.plan_for(torch.randn(256, 32))
    assert len(json.loads(path.read_text())) == 2
    # A damaged file or an entry that is not a plan is measured again (and repaired).
    path.write_text("{not json")
    monkeypatch.setattr(K, "_PLANS", {})
    timed.clear()
    monkeypatch.setattr(K, "_time", lambda fn, reps, **kw: timed.append(1) or real(fn, reps, **kw))
    assert len(K.plan_for(w)) == len(K.BUCKETS) and timed
    assert f"1024x32:float32:{torch.get_num_threads()}" in json.loads(path.read_text())
    path.write_text(
        json.dumps({f"1024x32:float32:{torch.get_num_threads()}": ["warp"] * len(K.BUCKETS)})
    )
    monkeypatch.setattr(K, "_PLANS", {})
    timed.clear()
    assert set(K.plan_for(w)) <= set(K.STRATEGIES) and timed
    # Switched off: nothing is read or written.
    assert K._plan_file(cache=False) is None


def _sdpa_reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 2, 5])
def test_few_query_attention_equals_sdpa_with_masks(q_len):
    torch.manual_seed(q_len)
    b, h, hkv, t, hd = 3, 9, 3, 40, 16
    q = torch.randn(b, h, q_len, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.ones(b, 1, q_len, t, dtype=torch.bool)
    mask[1, :, :, :10] = False  # left padding
    mask[2, :, :, 20:25] = False  # rolled-back holes
    for i in range(q_len):  # causal over the new positions
        mask[:, :, i, t - q_len + i + 1 :] = False
    module = torch.nn.Module()
    module.num_key_value_groups = h // hkv
    got, weights = few_query_attention(module, q, k, v, mask, scaling=0.25)
    assert weights is None and got.shape == (b, q_len, h, hd)
    assert torch.allclose(got, _sdpa_reference(q, k, v, mask, 0.25), atol=1e-5)
    # Additive float masks give the same.
    fmask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    got_f, _ = few_query_attention(module, q, k, v, fmask, scaling=0.25)
    assert torch.allclose(got_f, got, atol=1e-6)
    # A query row with no key at all stays finite (its output is never read).
    dead = mask.clone()
    dead[0] = False
    out, _ = few_query_attention(module, q, k, v, dead, scaling=0.25)
    assert torch.isfinite(out).all()


def test_left_padded_rows_attend_as_the_masked_product():
    torch.manual_seed(3)
    b, h, hkv, t, hd = 2, 9, 3, 30, 16
    q = torch.randn(b, h, 1, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    mask[0, ..., :12] = False
    holes = mask.clone()
    holes[1, ..., 5] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    for m in (mask, holes):
        got, _ = few_query_attention(module, q, k, v, m, scaling=0.25)
        assert torch.allclose(got, _sdpa_reference(q, k, v, m, 0.25), atol=1e-5)


def test_rows_of_different_lengths_attend_in_runs():
    """A fused step's short rows (pure contexts) beside long ones (RAG contexts), left-padded
    to the longest: each run of rows attends from its first visible key, and every row gets
    the product under the whole mask."""
    from tokrag_integrations.accel import sdpa as S

    torch.manual_seed(5)
    b, h, hkv, t, hd = 6, 9, 3, 700, 16
    starts = [640, 655, 600, 0, 30, 12]  # three short rows, then three long ones
    q = torch.randn(b, h, 1, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.zeros(b, 1, 1, t, dtype=torch.bool)
    for r, s in enumerate(starts):
        mask[r, ..., s:] = True
    mask[4, ..., 100] = False  # a hole inside a row is kept as a hole
    assert S._key_runs(mask, t) == [(0, 3, 600), (3, 6, 0)]
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    got, _ = few_query_attention(module, q, k, v, mask, scaling=0.25)
    assert torch.allclose(got, _sdpa_reference(q, k, v, mask, 0.25), atol=1e-5)
    # Rows of similar lengths: one call over every key; a mask changed in place is read again.
    even = torch.ones(b, 1, 1, t, dtype=torch.bool)
    even[:, ..., :5] = False
    assert S._key_runs(even, t) is None
    even[:3, ..., :650] = False
    assert S._key_runs(even, t) == [(0, 3, 650), (3, 6, 5)]
    assert S._cheapest_runs([0, 900, 0, 900], 950) == [(0, 1, 0), (1, 2, 900), (2, 3, 0), (3, 4, 900)]


def test_left_padded_layer_holds_what_cat_gives():
    a_k, a_v = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    b_k, b_v = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4)
    layer = GrowableLayer()
    layer.set_left_padded([a_k, b_k], [a_v, b_v])
    want_k = torch.cat([torch.cat([torch.zeros(1, 3, 4, 4), a_k], 2), b_k])
    want_v = torch.cat([torch.cat([torch.zeros(1, 3, 4, 4), a_v], 2), b_v])
    assert torch.equal(layer.keys, want_k) and torch.equal(layer.values, want_v)
    assert layer.get_seq_length() == 9
    k, _ = layer.update(torch.ones(3, 3, 1, 4), torch.ones(3, 3, 1, 4))  # grows in place
    assert k.shape == (3, 3, 10, 4) and torch.equal(k[:, :, :9], want_k)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 2, 4], [4, 0, 3], [2]])
@pytest.mark.parametrize("start", [0, 3])
def test_kept_rows_hold_what_indexing_gives_and_keep_growing(rows, start):
    k, v = torch.randn(5, 3, 9, 4), torch.randn(5, 3, 9, 4)
    layer = GrowableLayer()
    layer.update(k, v)
    layer.keep_rows(torch.tensor(rows), start)
    assert torch.equal(layer.keys, k[rows, :, start:]) and torch.equal(
        layer.values, v[rows, :, start:]
    )
    assert layer.get_seq_length() == 9 - start
    new_k, new_v = torch.randn(len(rows), 3, 1, 4), torch.randn(len(rows), 3, 1, 4)
    got_k, got_v = layer.update(new_k, new_v)
    assert torch.equal(got_k, torch.cat([k[rows, :, start:], new_k], 2))
    assert torch.equal(got_v, torch.cat([v[rows, :, start:], new_v], 2))


def _head(n=2048, k=64, bias=False):
    head = torch.nn.Linear(k, n, bias=bias)
    setattr(head, K._HEAD_OK, True)
    return head


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_head_computes_the_linear_product(monkeypatch, bias):
    head = _head(bias=bias)
    product = PH.packed_head(head, "on")
    assert product is not None and PH.packed_head(head, "on") is product  # made once per module
    with torch.inference_mode():
        for rows in (1, PH.HEAD_MIN_ROWS - 1, PH.HEAD_MIN_ROWS, 16, 40):
            x = torch.randn(rows, 64)
            out = product(x)
            assert out.shape == (rows, 2048)
            assert torch.allclose(out, F.linear(x, head.weight, head.bias), atol=1e-4, rtol=1e-4)
            if rows < PH.HEAD_MIN_ROWS:  # a few rows keep the routed product itself
                assert torch.equal(out, head(x))


def test_packed_head_only_where_allowed_and_measured(monkeypatch, tmp_path):
    """Off, a stock head (never set up by install) or a non-float32 head get no packed
    product; in ``auto`` the measured choice is kept on disk and read back untimed."""
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(PH, "_HEAD_CHOICE", {})
    assert PH.packed_head(_head(), "off") is None
    with pytest.raises(ValueError, match="packed_head must be 'auto', 'on' or 'off'"):
        PH.packed_head(_head(), "sometimes")
    assert PH.packed_head(torch.nn.Linear(64, 2048), "on") is None  # not set up by install()
    assert PH.packed_head(_head().to(torch.float64), "on") is None
    if not torch.backends.mkldnn.is_available():
        return
    # Fake timings: a timed run that calls the head module (the routed product) takes 1.0,
    # one that does not (the packed product) 0.5, whatever order they are timed in.
    calls = []
    head = _head()
    routed = []
    head.register_forward_hook(lambda *a: routed.append(1))

    def fake_time(fn, reps, **kw):
        n = len(routed)
        fn()
        calls.append(1)
        return 1.0 if len(routed) > n else 0.5

    monkeypatch.setattr(K, "_time", fake_time)
    assert PH.packed_head(head) is not None and calls
    stored = json.loads(K._side_file("head").read_text())
    assert stored == {f"2048x64:{torch.get_num_threads()}": True}
    # Read back in a "new process" without timing; a slower measurement is remembered too.
    monkeypatch.setattr(PH, "_HEAD_CHOICE", {})
    monkeypatch.setattr(K, "_time", lambda fn, reps, **kw: pytest.fail("stored choice re-measured"))
    assert PH.packed_head(_head()) is not None
    K._side_file("head").write_text(json.dumps({f"2048x64:{torch.get_num_threads()}": False}))
    monkeypatch.setattr(PH, "_HEAD_CHOICE", {})
    slow = _head()
    # A stored "slower" makes no copy of the weight at all.
    monkeypatch.setattr(torch.Tensor, "to_mkldnn", lambda *a, **k: pytest.fail("copied"))
    assert PH.packed_head(slow) is None and getattr(slow, K._HEAD) is False
