"""The authors' released rule (policies/tokrag_authors.py) on hand-made tensors, and its
skip / gate masks on the real default tokenizer.

This file holds the cases that need a model, a database or a server are in
``tests/integration/test_tokrag_authors.py``."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.policies import tokrag_authors as R

V = 16


def eye(v: int = V) -> torch.Tensor:
    """One-hot embeddings: token t embeds as e_t, so cosines are easy to read."""
    return torch.eye(v)


def probs(**weights: float) -> torch.Tensor:
    """A distribution over V with the given masses on tokens t<i> and the rest spread thinly."""
    p = torch.full((V,), 1e-6)
    for k, w in weights.items():
        p[int(k[1:])] = w
    return p / p.sum()


def attention(m_or_values, *, heads: int = 2, extra: int = 0) -> torch.Tensor:
    """[H, T] attention with the given per-position values on every head (T = m + extra)."""
    vals = torch.as_tensor(m_or_values, dtype=torch.float)
    row = torch.cat([vals, torch.zeros(extra)])
    return row.repeat(heads, 1)


def run(attn, rt_ids, rag, pure, *, emb=None, positions=None, **kw):
    rt_ids = torch.as_tensor(rt_ids, dtype=torch.long)
    pos = torch.arange(rt_ids.numel()) if positions is None else torch.as_tensor(positions)
    return R.authors_signals(attn, pos, rt_ids, rag, pure, eye() if emb is None else emb, **kw)


# ---------------------------------------------------------------- cos_ir: single tokens, max
def test_max_over_single_tokens_not_window_mean():
    # w_RAG = e5 (top-2: t5 and t5-direction only: give t5 nearly all mass).
    rag = probs(t5=0.99)
    pure = probs(t9=0.99)
    # Most attended position is index 2 (token 5), its window i-2..i+1 holds tokens 1,2,5,3.
    sig = run(attention([0.1, 0.1, 0.6, 0.1, 0.1]), [1, 2, 5, 3, 4], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)  # a window mean would give 0.5
    assert sig["best_token"] == 5
    assert sig["attended"] == [5]
    assert sig["benefit"] is True


def test_window_is_asymmetric_i_minus_2_to_i_plus_1():
    rag = probs(t7=0.99)
    pure = probs(t9=0.99)
    att = attention([0.0, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
    # token 7 at i+2 (index 6): outside their window -> cos_ir is the 0 floor.
    sig = run(att, [1, 1, 1, 1, 2, 3, 7, 1, 1], rag, pure, n_positions=1)
    assert sig["cos_ir"] == 0.0 and sig["best_token"] is None
    # token 7 at i-2 (index 2): inside.
    sig = run(att, [1, 1, 7, 1, 2, 3, 4, 1, 1], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)
    # token 7 at i+1 (index 5): inside.
    sig = run(att, [1, 1, 1, 1, 2, 7, 4, 1, 1], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)
    # window (0, 0): the single attended token only.
    sig = run(att, [1, 1, 1, 1, 2, 7, 4, 1, 1], rag, pure, n_positions=1, window=(0, 0))
    assert sig["cos_ir"] == 0.0


def test_window_clipped_at_span_edges():
    rag = probs(t7=0.99)
    pure = probs(t9=0.99)
    sig = run(attention([0.9, 0.05, 0.05]), [2, 7, 3], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)
    sig = run(attention([0.05, 0.05, 0.9]), [7, 2, 3], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)  # i-2 = 0


def test_floor_at_zero_and_no_floor():
    emb = eye()
    emb[3] = -emb[5]  # token 3 points away from w_RAG = e5
    rag = probs(t5=0.99)
    pure = probs(t4=0.5, t3=0.49)  # w_LLM has a negative cosine with w_RAG
    sig = run(attention([1.0]), [3], rag, pure, emb=emb, n_positions=1)
    assert sig["cos_ir"] == 0.0  # their running max starts at 0
    assert sig["cos_llm"] < 0 and sig["benefit"] is True
    sig = run(attention([1.0]), [3], rag, pure, emb=emb, n_positions=1, floor=None)
    assert sig["cos_ir"] == pytest.approx(-1.0, abs=1e-4)


# ---------------------------------------------------------------- selection: skip, ranking
def test_skipped_token_with_highest_attention_is_not_used():
    skip = torch.zeros(V, dtype=torch.bool)
    skip[11] = True  # say token 11 is '.'
    rag = probs(t11=0.99)  # w_RAG points at the '.' token itself
    pure = probs(t9=0.99)
    ids = [11, 1, 1, 1, 1, 2, 3, 4, 1, 1]
    att = attention([0.5, 0, 0, 0, 0, 0.2, 0.15, 0.1, 0.05, 0])
    sig = run(att, ids, rag, pure, skip=skip)
    assert sig["attended_index"] == [5, 6, 7]
    assert sig["attended"] == [2, 3, 4]
    assert 11 not in sig["attended"]
    assert sig["cos_ir"] == 0.0 and sig["benefit"] is False
    no_skip = run(att, ids, rag, pure)
    assert no_skip["attended"][0] == 11
    assert no_skip["cos_ir"] == pytest.approx(1.0, abs=1e-4) and no_skip["benefit"] is True


def test_skipped_positions_do_not_count_toward_n_positions():
    skip = torch.zeros(V, dtype=torch.bool)
    skip[[10, 12]] = True
    ids = [10, 2, 12, 3, 4, 5]
    att = attention([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])
    sig = run(att, ids, probs(t5=0.9), probs(t9=0.9), skip=skip, n_positions=3, window=(0, 0))
    assert sig["attended"] == [2, 3, 4]


def test_ranking_uses_raw_head_mean_not_renormalised():
    # Two retrieved positions A (token 2) and B (token 3) plus one non-retrieved key.
    # head 0: almost all mass off the span, A 0.02, B 0.0 -> renormalised A 1.0, B 0.0
    # head 1: A 0.4, B 0.6.  Raw mean: A 0.21 < B 0.30; renormalised: A 0.7 > B 0.3.
    attn = torch.tensor([[0.02, 0.0, 0.98], [0.4, 0.6, 0.0]])
    sig = run(
        attn, [2, 3], probs(t5=0.9), probs(t9=0.9), positions=[0, 1], n_positions=1, window=(0, 0)
    )
    assert sig["attended"] == [3]


def test_positions_index_attention_windows_run_over_the_span():
    # Retrieved tokens sit at non-contiguous cache positions; the window is over span order.
    T = 12
    positions = [3, 4, 5, 9, 10]
    row = torch.zeros(T)
    row[9] = 0.8  # span index 3 (token 4); its window: span indices 1..4
    row[0] = 0.2  # not retrieved
    attn = row.repeat(2, 1)
    sig = run(
        attn, [7, 1, 2, 4, 5], probs(t7=0.99), probs(t9=0.99), positions=positions, n_positions=1
    )
    assert sig["attended"] == [4]
    assert sig["cos_ir"] == 0.0  # token 7 is span index 0 = i-3: outside
    sig = run(
        attn, [1, 7, 2, 4, 5], probs(t7=0.99), probs(t9=0.99), positions=positions, n_positions=1
    )
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)


def test_max_ranked_and_rank_offset_token_level_preset():
    kw = R.preset_kwargs("token_level")
    assert kw["n_positions"] == 5 and kw["rank_offset"] == 2 and kw["window"] == (0, 0)
    m = 12
    vals = torch.linspace(1.0, 0.1, m)  # rank r = span index r
    ids = list(range(m))
    # w_RAG = e0: token 0 is the most attended -> dropped by cos_sim[2:7].
    sig = run(attention(vals), ids, probs(t0=0.99), probs(t13=0.99), **kw)
    assert sig["attended_index"] == [2, 3, 4, 5, 6]
    assert sig["cos_ir"] == pytest.approx(0.0, abs=1e-4)
    # token at rank 6 counts, rank 7 does not.
    sig = run(attention(vals), ids, probs(t6=0.99), probs(t13=0.99), **kw)
    assert sig["cos_ir"] == pytest.approx(1.0, abs=1e-4)
    sig = run(attention(vals), ids, probs(t7=0.99), probs(t13=0.99), **kw)
    assert sig["cos_ir"] == pytest.approx(0.0, abs=1e-4)
    # max_ranked caps the walk: with 100 ranked and only skips among the top, fewer are used.
    skip = torch.zeros(V, dtype=torch.bool)
    skip[[0, 1]] = True
    sig = run(
        attention(vals), ids, probs(t5=0.9), probs(t13=0.9), skip=skip, max_ranked=3, window=(0, 0)
    )
    assert sig["attended"] == [2]


def test_empty_selection_gives_floor():
    skip = torch.ones(V, dtype=torch.bool)
    sig = run(attention([0.5, 0.5]), [1, 2], probs(t5=0.9), probs(t9=0.9), skip=skip)
    assert sig["attended"] == [] and sig["cos_ir"] == 0.0
    sig = run(attention([0.5, 0.5]), [1, 2], probs(t5=0.9), probs(t9=0.9), skip=skip, floor=None)
    assert sig["cos_ir"] == -1.0


# ---------------------------------------------------------------- w_RAG / w_LLM top-k
def test_top_k_truncation_of_w_rag():
    rag = probs(t0=0.4, t1=0.35, t2=0.25)
    pure = probs(t2=0.9, t5=0.05, t6=0.05)
    att = attention([1.0])
    two = run(att, [9], rag, pure)  # default top_k_rag=2: w_RAG on e0, e1 only
    assert two["cos_llm"] == pytest.approx(0.0, abs=1e-4)
    three = run(att, [9], rag, pure, top_k_rag=3)
    assert three["cos_llm"] > 0.2


def test_top_k_truncation_of_w_llm():
    rag = probs(t0=0.6, t1=0.3)
    pure = probs(t2=0.5, t5=0.2, t6=0.2, t0=0.1)  # t0 is the 4th token of the pure LLM
    att = attention([1.0])
    assert run(att, [9], rag, pure)["cos_llm"] == pytest.approx(0.0, abs=1e-4)
    assert run(att, [9], rag, pure, top_k_llm=4)["cos_llm"] > 0.05


def test_weighting_is_by_probability():
    rag = probs(t0=0.8, t1=0.1)
    pure = probs(t0=0.1, t1=0.8, t2=0.05)
    sig = run(attention([1.0]), [9], rag, pure)
    w_rag = torch.tensor([0.8, 0.1]) / torch.tensor([0.8, 0.1]).norm()
    w_llm = torch.tensor([0.1, 0.8, 0.05]) / torch.tensor([0.1, 0.8, 0.05]).norm()
    assert sig["cos_llm"] == pytest.approx(float(w_rag @ w_llm[:2]), abs=1e-3)


# ---------------------------------------------------------------- decision
def test_decision_is_strict_and_uses_rate():
    rag = probs(t5=0.99)
    pure = probs(t5=0.99)
    sig = run(attention([1.0]), [5], rag, pure, n_positions=1)
    assert sig["cos_ir"] == pytest.approx(sig["cos_llm"], abs=1e-6)
    assert sig["benefit"] is False  # their test is rate * cos_ir > cos_llm
    assert run(attention([1.0]), [5], rag, pure, n_positions=1, rate=1.1)["benefit"] is True
    assert math.isclose(sig["margin"], sig["cos_ir"] - sig["cos_llm"], abs_tol=1e-9)


def test_authors_layer():
    assert R.authors_layer(32) == 20  # outputs.attentions[20]
    assert R.authors_layer(32, "token_level") == 16
    assert R.authors_layer(30) == 19  # round(18.75), 0-based
    assert R.authors_layer(1) == 0
