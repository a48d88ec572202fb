"""The speed-path choices made by measurement (never slower than the plain path on the whole
model) and ``tokrag bench --throughput`` (arms interleaved, ratios per round).

This file holds the cases that need a model, a database or a server are in
``tests/integration/test_bench_choices.py``."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tokrag_eval import cost as BT
from tokrag_eval.commands import _sizes
from tokrag_eval.cost import measure_throughput
from tokrag_eval.report import bench_table
from tokrag_integrations.accel import cpu_kernels as K
from tokrag_integrations.accel import install as accel_install
from tokrag_integrations.cli import build_parser


def _routed_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Linear(64, 4096))
    K._PLANS[(4096, 64, torch.float32, torch.get_num_threads())] = (
        "dup", "wxt", "wxt", "linear", "linear", "linear", "linear"
    )
    assert K.install(model, "auto") == 2
    return model


def test_a_bucket_slower_on_the_whole_model_goes_back_to_the_stock_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKRAG_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKRAG_KERNEL_PLAN_CACHE", raising=False)
    monkeypatch.setattr(K, "_PLANS", {})
    model = _routed_model()
    timed = []
    # Whole-model ratios (plans / stock): 1 row faster, 2 rows slower, 3-4 rows a tie.
    fake = {1: 0.8, 2: 1.3, 3: K.VERIFY_GAIN}

    def fake_bucket(_model, _mods, rows, _rounds):
        timed.append(rows)
        return fake[rows]

    monkeypatch.setattr(K, "_verify_bucket", fake_bucket)
    verdict = K.verify_install(model)
    assert sorted(timed) == [1, 2, 3]  # buckets whose plan is F.linear are not timed
    assert verdict == {
        "rows 1": {"ratio": 0.8, "kept": True},
        "rows 2": {"ratio": 1.3, "kept": False},
        "rows 3-4": {"ratio": K.VERIFY_GAIN, "kept": False},
    }
    for mod in model:
        table = getattr(mod, K._PLAN)
        assert table[1] is K._k_dup
        assert table[2] is table[3] is table[4] is K._k_linear
        assert getattr(mod, K._PLAN_NAMES) == ("dup",) + ("linear",) * 6
    paths = speed_paths_of(model)
    assert "rows 2 1.30x -> stock" in paths and "rows 1 0.80x kept" in paths
    # A later process applies the stored verdicts without timing anything.
    stored = json.loads(K._side_file("verify").read_text())
    assert list(stored.values()) == [{"rows 1": 0.8, "rows 2": 1.3, "rows 3-4": K.VERIFY_GAIN}]
    K.uninstall(model)
    monkeypatch.setattr(K, "_PLANS", {})
    model = _routed_model()
    monkeypatch.setattr(K, "_verify_bucket", lambda *a: pytest.fail("stored verdict re-measured"))
    assert K.verify_install(model)["rows 2"]["kept"] is False
    # Every bucket slower: the modules get their stock forward back.
    K.uninstall(model)
    monkeypatch.setattr(K, "_PLANS", {})
    model = _routed_model()
    monkeypatch.setattr(K, "_verify_bucket", lambda *a: 1.5)
    K.verify_install(model, cache=False)  # the stored verdicts are not read
    assert not K.installed(model) and all("forward" not in m.__dict__ for m in model)


def speed_paths_of(model: torch.nn.Module) -> str:
    return accel_install._kernel_detail(model)


def test_plans_are_chosen_by_the_median_of_interleaved_rounds(monkeypatch):
    """One round where F.linear met a burst of load does not make another strategy win."""
    monkeypatch.setattr(K, "_PLANS", {})
    order: list[str] = []
    rounds = {"n": 0}

    def fake_time(fn, reps, warm=True):
        name = fn.__defaults__[0]  # the strategy the timed lambda runs
        order.append(name)
        rounds["n"] += 1
        # F.linear is 10x slower in its first timing of every bucket (a burst of load), the
        # others always 1.0 and F.linear otherwise 0.95.
        if name == "linear":
            return 10.0 if order.count("linear") % K.PLAN_ROUNDS == 1 else 0.95
        return 1.0

    monkeypatch.setattr(K, "_time", fake_time)
    plan = K.plan_for(torch.randn(256, 32), cache=False)
    assert plan == ("linear",) * len(K.BUCKETS)
    # The order is rotated from round to round: F.linear is not always timed first.
    firsts = order[:: len(order) // (len(K.BUCKETS) * K.PLAN_ROUNDS)]
    assert len(set(firsts)) > 1


def test_throughput_interleaves_the_arms_and_pairs_the_ratios(monkeypatch):
    calls: list[tuple[str, int]] = []

    class R:
        def __init__(self, n):
            self.trace = type("T", (), {"steps": [0] * n})()

    def fake_batch(lm, queries, passages, *, policy, max_new_tokens, **opts):
        calls.append((policy, len(queries)))
        return [R(4) for _ in queries]

    monkeypatch.setattr("tokrag_integrations.engine.scheduler.generate_batch", fake_batch)
    items = [(f"q{i}", ["p"]) for i in range(5)]
    out = measure_throughput(lambda name: None, items, (1, 2), 4, ("rag", "floor", "tokrag"), False, 3)
    assert len(calls) == 3 * 2 * 3
    # Each size of each round runs all three arms, starting with a different arm each time.
    groups = [calls[i : i + 3] for i in range(0, len(calls), 3)]
    assert all(sorted(p for p, _ in g) == ["floor", "rag", "tokrag"] for g in groups)
    assert len({g[0][0] for g in groups}) == 3
    assert set(out["arms"]) == {"rag", "floor", "tokrag"}
    assert set(out["ratios"]) == {"floor / rag", "tokrag / rag"}
    r = out["ratios"]["tokrag / rag"]["2"]
    assert r["min"] <= r["median"] <= r["max"]
    assert len(out["arms"]["rag"]["2"]["per_round"]) == 3
    report = bench_table(
        {
            "model": "m", "device": "cpu", "torch_threads": 1, "questions": 1, "passages": 1,
            "mean_prompt_tokens": 1.0, "max_new_tokens": 4, "policies": {},
            "throughput": out, "paths": {"cpu_kernels": "on"},
        }
    )
    assert "| tokrag / rag, per round: median [min, max] |" in report
    assert "- cpu_kernels: on" in report
    with pytest.raises(ValueError, match="rounds"):
        measure_throughput(lambda name: None, items, (1,), 4, ("rag",), False, 0)


def test_throughput_reports_questions_per_second_beside_tokens_per_second(monkeypatch):
    # A clock the fake decode advances: tokrag takes 1.1 s a batch and writes 3 tokens an
    # answer, rag 1.0 s and 4 tokens. Tokens/s then counts tokrag's shorter answers against
    # it; questions/s does not.
    now = [0.0]

    class R:
        def __init__(self, n):
            self.trace = type("T", (), {"steps": [0] * n, "timings": {"decode_s": 0.5}})()

    def fake_batch(lm, queries, passages, *, policy, max_new_tokens, **opts):
        now[0] += 1.1 if policy == "tokrag" else 1.0
        return [R(3 if policy == "tokrag" else 4) for _ in queries]

    monkeypatch.setattr("tokrag_integrations.engine.scheduler.generate_batch", fake_batch)
    monkeypatch.setattr(BT, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0])}))
    items = [(f"q{i}", ["p"]) for i in range(4)]
    out = measure_throughput(lambda name: None, items, (2,), 4, ("rag", "tokrag"), False, 2)
    assert out["arms"]["rag"]["2"]["questions_per_s"] == pytest.approx(2.0)
    assert out["arms"]["tokrag"]["2"]["questions_per_s"] == pytest.approx(2 / 1.1)
    assert out["question_ratios"]["tokrag / rag"]["2"]["median"] == pytest.approx(1 / 1.1)
    assert out["ratios"]["tokrag / rag"]["2"]["median"] == pytest.approx((3 / 1.1) / 4)
    report = bench_table(
        {
            "model": "m", "device": "cpu", "torch_threads": 1, "questions": 1, "passages": 1,
            "mean_prompt_tokens": 1.0, "max_new_tokens": 4, "policies": {}, "throughput": out,
        }
    )
    assert "| tokrag / rag of questions / s, per round: median [min, max] | 0.909" in report
    assert "| rag, questions / s | 2.00 |" in report


def test_bench_refuses_bad_batch_sizes():
    with pytest.raises(argparse.ArgumentTypeError, match="batch sizes"):
        _sizes("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match=">= 1"):
        _sizes("0,4")
    assert _sizes("1, 4,16") == (1, 4, 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--throughput", "0,4"])


def test_left_padded_rows_of_a_wide_batch_attend_as_the_masked_product():
    """A fused batch of many rows (pure rows padded far to the left, then RAG rows): the
    same attention as the masked product over every key."""
    from tokrag_integrations.accel.sdpa import few_query_attention

    torch.manual_seed(5)
    b, h, hkv, t, hd = 8, 9, 3, 400, 16
    starts = [350, 340, 355, 350, 0, 20, 5, 0]
    q = torch.randn(b, h, 1, hd)
    k = torch.randn(b, hkv, t, hd)
    v = torch.randn(b, hkv, t, hd)
    mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
    for r, s_ in enumerate(starts):
        mask[r, ..., :s_] = False
    module = torch.nn.Module()
    module.num_key_value_groups = 3
    got, _ = few_query_attention(module, q, k, v, mask, scaling=0.25)
    assert torch.allclose(got, _sdpa_reference(q, k, v, mask, 0.25), atol=1e-5)
    # All rows starting at the same key past the first: one run, no mask.
    same = torch.ones(b, 1, 1, t, dtype=torch.bool)
    same[..., :30] = False
    got, _ = few_query_attention(module, q, k, v, same, scaling=0.25)
    assert torch.allclose(got, _sdpa_reference(q, k, v, same, 0.25), atol=1e-5)


def _sdpa_reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), attn_mask=mask, scale=scale
    )
    return out.transpose(1, 2)


def test_bench_questions_come_from_data_or_the_data_folder(tmp_path, monkeypatch):
    """No path walking into a checkout: ``--data``, else ``$TOKRAG_DATA_DIR/squad_dev.jsonl``,
    else an error naming both."""
    from tokrag_eval.cost import arm, bench_items, data_path

    monkeypatch.delenv("TOKRAG_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match=r"--data PATH.*\$TOKRAG_DATA_DIR"):
        data_path(None)
    rows = [
        {"id": i, "question": f"q{i}", "answers": ["a"], "positives": ["pos"], "negatives": [f"n{j}" for j in range(k)]}
        for i, k in enumerate((4, 2, 6))
    ]
    (tmp_path / "squad_dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("TOKRAG_DATA_DIR", str(tmp_path))
    assert data_path(None) == tmp_path / "squad_dev.jsonl"
    assert data_path("x.jsonl").name == "x.jsonl"
    items = bench_items(data_path(None), 5, 5)
    # Items with fewer than 5 passages are skipped; the positive and the first negatives are kept.
    assert [q for q, _ in items] == ["q0", "q2"]
    assert sorted(items[1][1]) == ["n0", "n1", "n2", "n3", "pos"]
    assert items == bench_items(data_path(None), 5, 5)  # a fixed shuffle
    with pytest.raises(ValueError, match="no usable items"):
        bench_items(data_path(None), 5, 8)
    assert arm("tokrag-step") == ("tokrag", {"speed": "reference"})
    assert arm("tokrag[min_fusion_layer=0]") == ("tokrag", {"policy_options": {"min_fusion_layer": 0}})


def test_bench_arms_stock_baselines_and_speed_presets(monkeypatch):
    from tokrag_eval.cost import DEFAULT_POLICIES, STOCK_ARMS, arm

    assert arm("hf-generate") == arm("hf-generate-static") == ("rag", {})
    assert {"rag-kernels-off", "hf-generate", "hf-generate-static"} == STOCK_ARMS
    assert "hf-generate" in DEFAULT_POLICIES and "rag-stock" not in DEFAULT_POLICIES
    assert arm("tokrag@cuda") == ("tokrag", {"speed": "cuda"})
    assert arm("tokrag[min_fusion_layer=0]@reference") == (
        "tokrag", {"policy_options": {"min_fusion_layer": 0}, "speed": "reference"}
    )
    monkeypatch.setitem(BT.ARMS, "tokrag@view", ("tokrag", {"speed": {"static": "off"}}))
    assert arm("tokrag@view") == ("tokrag", {"speed": {"static": "off"}})  # a named arm first
    with pytest.raises(ValueError, match="take no speed preset"):
        arm("hf-generate@cuda")
    with pytest.raises(ValueError, match="'rag-stock' is now called 'rag-kernels-off'.*'hf-generate'"):
        arm("rag-stock")
