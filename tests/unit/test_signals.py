"""Tok-RAG signals on hand-made tensors with known answers (Eq. 13–19)."""

from __future__ import annotations

import math

import pytest
import torch

from tokrag_integrations.policies import signals as S


def test_jsd_symmetric_bounded_and_zero_on_identity():
    p = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.1, 0.3, 0.6])
    assert S.jsd(p, q).item() == pytest.approx(S.jsd(q, p).item(), abs=1e-12)
    assert S.jsd(p, p).item() == pytest.approx(0.0, abs=1e-12)
    # Disjoint supports reach the upper bound ln 2 (nats).
    assert S.jsd(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])).item() == pytest.approx(math.log(2))
    # Hand computation: p=(1,0), q=(.5,.5): m=(.75,.25);
    # KL(p||m)=ln(4/3); KL(q||m)=.5 ln(2/3)+.5 ln 2.
    want = 0.5 * math.log(4 / 3) + 0.5 * (0.5 * math.log(2 / 3) + 0.5 * math.log(2))
    assert S.jsd(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])).item() == pytest.approx(want)


def test_jsd_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        S.jsd(torch.ones(3) / 3, torch.ones(4) / 4)


def test_jsd_finite_with_subnormal_probabilities():
    # Logit-lens distributions of peaked layers hold probabilities below 1e-45: half of one
    # rounds to 0, which made log m = -inf and the JSD inf (then g(l) = |inf - inf| = NaN).
    logits = torch.tensor([[0.0, -30.0, -103.3], [-5.0, 0.0, -300.0]])
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    assert p[0, 2].item() > 0 and (0.5 * (p[0, 2] + p[1, 2])).item() == 0.0  # rounds to 0
    d = S.jsd(p[0], p[1])
    assert torch.isfinite(d) and 0 < d.item() <= math.log(2)
    shift = S.layer_shift_jsd_logp(logp)
    assert torch.isfinite(shift).all()
    assert shift[0].item() == pytest.approx(d.item(), rel=1e-5)


def test_layer_shift_jsd_logp_matches_jsd():
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 4
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    want = S.jsd(p[:-1], p[1:])
    got = S.layer_shift_jsd_logp(logp)
    assert torch.allclose(got, want, atol=1e-6)
    same = S.layer_shift_jsd_logp(torch.stack([logp[0], logp[0]]))
    assert same.item() == pytest.approx(0.0, abs=1e-6)
    # Several contexts at once give each context's shifts, bit for bit.
    other = torch.log_softmax(torch.randn(5, 300) * 2, dim=-1)
    both = S.layer_shift_jsd_logp(torch.stack([logp, other]))
    assert both.shape == (2, 4)
    assert torch.equal(both[0], got) and torch.equal(both[1], S.layer_shift_jsd_logp(other))
    assert torch.allclose(both[1], S.jsd(other.exp()[:-1], other.exp()[1:]), atol=1e-6)
    with pytest.raises(ValueError, match="L >= 1"):
        S.layer_shift_jsd_logp(logp[:1])


def test_layer_shift_and_gap():
    lens = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    shift = S.jsd(lens[:-1], lens[1:])  # consecutive layers
    assert shift.shape == (2,)
    assert shift[1].item() == pytest.approx(0.0, abs=1e-12)
    assert shift[0].item() > 0
    g = S.distribution_change_gap(torch.tensor([0.3, 0.1]), torch.tensor([0.1, 0.4]))
    assert torch.allclose(g, torch.tensor([0.2, 0.3]))


def test_retrieved_attention_mass_averages_heads():
    # 2 layers, 2 heads, 4 positions; retrieved positions 1 and 2.
    attn = torch.tensor(
        [
            [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]],
            [[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]],
        ]
    )
    f = S.retrieved_attention_mass(attn, torch.tensor([1, 2]))
    assert torch.allclose(f, torch.tensor([0.5, 0.75]))


def test_fusion_layer_known_answer_and_threshold_scale():
    f = torch.tensor([0.1, 0.2, 0.9, 0.3, 0.2, 0.1])  # argmax at layer 3
    vocab = 1000
    # a = 5e-7 per entry -> bound 5e-4 on the summed JSD.
    g = torch.tensor([1e-4, 4e-4, 4.9e-4, 6e-4, 1e-2, 1e-2])  # first crossing at layer 4
    l_star, fa, gf = S.fusion_layer(f, g, vocab_size=vocab)
    assert (fa, gf, l_star) == (3, 4, 3)  # floor((3 + 4) / 2)
    # Without the per-entry scale every layer would cross: the scale matters.
    assert S.first_crossing(g, 5e-7) == 1


def test_fusion_layer_no_crossing_uses_L():
    f = torch.tensor([0.9, 0.1, 0.1, 0.1])
    g = torch.zeros(4)
    assert S.fusion_layer(f, g, vocab_size=10) == ((1 + 4) // 2, 1, 4)


def test_fusion_layer_min_fusion_layer_skips_low_layers():
    f = torch.tensor([0.9, 0.1, 0.5, 0.2, 0.1])
    g = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0])
    # min_fusion_layer=3: argmax over layers 3..5 -> 3; first crossing >= 3 -> 5.
    assert S.fusion_layer(f, g, vocab_size=1, threshold=0.5, min_fusion_layer=3) == (4, 3, 5)
    with pytest.raises(ValueError, match="min_fusion_layer"):
        S.fusion_layer(f, g, vocab_size=1, min_fusion_layer=9)


def test_fusion_layer_accepts_lazily_computed_g():
    f = torch.tensor([0.1, 0.9, 0.1, 0.1])
    g = torch.tensor([0.0, 2.0, float("nan"), float("nan")])  # computed only up to a crossing
    assert S.fusion_layer(f, g, vocab_size=1, threshold=1.0) == (2, 2, 2)


def test_renormalised_attention_per_head_then_mean():
    attn = torch.tensor([[0.1, 0.3, 0.1, 0.5], [0.6, 0.1, 0.3, 0.0]])  # [H=2, T=4]
    att = S.renormalised_attention(attn, torch.tensor([1, 2]))
    # head 0: (0.3, 0.1)/0.4 = (.75, .25); head 1: (0.1, 0.3)/0.4 = (.25, .75)
    assert torch.allclose(att, torch.tensor([0.5, 0.5]))
    assert att.sum().item() == pytest.approx(1.0)


def test_rising_token_unconstrained_is_the_literal_argmax():
    final = torch.tensor([1.0, 5.0, 2.0])
    mid = torch.tensor([0.0, 4.5, -3.0])
    assert S.rising_token(final, mid, alpha=None) == 2  # rises by 5 over the whole vocabulary


def test_rising_token_high_norm_token_outside_the_plausible_set_is_never_chosen():
    # Token 3 is a junk token whose logit rises most (large embedding norm) but whose final
    # probability is far below alpha * max: DoLa's constraint leaves it out.
    final_logits = torch.tensor([8.0, 7.5, 0.0, 3.0])
    mid_logits = torch.tensor([6.0, 4.0, 0.0, -20.0])
    final, mid = torch.log_softmax(final_logits, 0), torch.log_softmax(mid_logits, 0)
    assert S.rising_token(final, mid, alpha=None) == 3
    # plausible: p >= 0.1 * max -> tokens 0 and 1; token 1 rises by 3.5 > 2.0.
    assert S.plausible_tokens(final, 0.1).tolist() == [True, True, False, False]
    assert S.rising_token(final, mid, alpha=0.1) == 1
    # alpha = 1 keeps only the top token.
    assert S.rising_token(final, mid, alpha=1.0) == 0
    # Shift invariance: raw logits give the same answer as log-probabilities.
    assert S.rising_token(final_logits, mid_logits, alpha=0.1) == 1
    with pytest.raises(ValueError, match="alpha"):
        S.rising_token(final, mid, alpha=0.0)


def test_default_min_fusion_layer_is_mid_depth_and_the_spec_start_stays_reachable():
    assert S.default_min_fusion_layer(30) == 15
    assert S.default_min_fusion_layer(18) == 9
    assert S.default_min_fusion_layer(1) == 1
    assert S.default_min_fusion_layer(32, S.SHALLOW_STAGE_FRACTION) == 10
    assert S.default_min_fusion_layer(30, S.SHALLOW_STAGE_FRACTION) == 9
    assert S.default_min_fusion_layer(2, S.SHALLOW_STAGE_FRACTION) == 1
    with pytest.raises(ValueError, match="fraction"):
        S.default_min_fusion_layer(30, 0.0)


def test_fusion_layer_picks_the_middle_maximum_over_a_larger_shallow_peak():
    # f peaks at layer 2 (shallow lexical stage), dips, then rises to a smaller middle
    # maximum at layer 7; g crosses at layer 1 and again from layer 6.
    f = torch.tensor([0.5, 0.9, 0.4, 0.2, 0.3, 0.5, 0.6, 0.3, 0.1, 0.05])
    g = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    literal = S.fusion_layer(f, g, vocab_size=1, threshold=0.5, min_fusion_layer=0)
    assert literal == ((2 + 1) // 2, 2, 1)
    lo = S.default_min_fusion_layer(10, S.SHALLOW_STAGE_FRACTION)  # 3
    assert S.fusion_layer(f, g, vocab_size=1, threshold=0.5, min_fusion_layer=lo) == ((7 + 6) // 2, 7, 6)


def test_distribution_scores_follow_theorem_3():
    p_rag = torch.tensor([0.6, 0.3, 0.05, 0.05])
    p_llm = torch.tensor([0.05, 0.9, 0.03, 0.02])
    near = torch.tensor([0.7, 0.2, 0.1, 0.0])  # p_R close to p_RAG: benefit
    far = torch.tensor([0.0, 0.0, 0.0, 1.0])  # p_R on a token RAG barely wants: detriment
    d_ir, d_llm = S.distribution_scores(p_rag, p_llm, near, support_k=4)
    assert d_ir < d_llm
    d_ir2, d_llm2 = S.distribution_scores(p_rag, p_llm, far, support_k=4)
    assert d_ir2 > d_llm2 and d_llm2 == pytest.approx(d_llm)
    assert d_ir == pytest.approx(S.jsd(p_rag, near).item())


def test_word_similarity_is_softmax_of_dot_products():
    A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    ws = S.word_similarity(A, 2, torch.tensor([0, 1, 2]))
    want = torch.softmax(torch.tensor([1.0, 1.0, 2.0]), 0)
    assert torch.allclose(ws, want)


def test_retrieval_distribution_both_norms():
    att = torch.tensor([0.5, 0.3, 0.2])
    ws = torch.tensor([0.2, 0.2, 0.6])
    prod = att * ws  # .10 .06 .12
    assert torch.allclose(S.retrieval_distribution(att, ws, pr_norm="sum"), prod / prod.sum())
    soft = S.retrieval_distribution(att, ws, pr_norm="softmax")
    assert torch.allclose(soft, torch.softmax(prod, 0))
    # The literal softmax is nearly uniform (the reason the spec offers "sum").
    assert soft.max() - soft.min() < 0.03
    with pytest.raises(ValueError, match="pr_norm"):
        S.retrieval_distribution(att, ws, pr_norm="max")


def test_p_r_with_repeated_tokens_maps_to_vocab():
    A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0]])
    rt_ids = torch.tensor([2, 1, 2])  # token 2 appears twice
    p_r = torch.tensor([0.2, 0.5, 0.3])
    vocab = S.positions_to_vocab(p_r, rt_ids, 3)
    assert torch.allclose(vocab, torch.tensor([0.0, 0.5, 0.5]))
    w_ir = S.retrieval_embedding(A, p_r, rt_ids)
    assert torch.allclose(w_ir, vocab @ A)  # equal to mapping onto the vocabulary first
    assert torch.allclose(w_ir, torch.tensor([1.5, 2.5]))


def test_weighted_embedding_full_and_top_k():
    A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])
    p = torch.tensor([0.1, 0.4, 0.3, 0.2])
    assert torch.allclose(S.weighted_embedding(p, A), torch.tensor([0.8, 0.7]))
    # top-2 = tokens 1 (0.4) and 2 (0.3): (0.4*[0,1] + 0.3*[1,1]) / 0.7
    assert torch.allclose(S.weighted_embedding(p, A, top_k=2), torch.tensor([0.3, 0.7]) / 0.7)
    # Unnormalised weights give the same direction-normalised result.
    assert torch.allclose(S.weighted_embedding(p * 5, A), torch.tensor([0.8, 0.7]))
    # Batched form equals row by row.
    both = S.weighted_embedding(torch.stack([p, p.flip(0)]), A, top_k=2)
    assert torch.allclose(both[1], S.weighted_embedding(p.flip(0), A, top_k=2))
    with pytest.raises(ValueError, match="top_k"):
        S.weighted_embedding(p, A, top_k=0)


def test_rule_eq19():
    assert S.benefit_wins(0.5, 0.4)
    assert S.benefit_wins(0.4, 0.4)  # ties go to benefit (>=)
    assert not S.benefit_wins(0.39, 0.4)
    with pytest.raises(ValueError):
        S.benefit_wins(float("nan"), 0.1)


def test_cosine_and_entropy():
    assert S.cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == pytest.approx(0.0)
    assert S.entropy(torch.tensor([0.5, 0.5])).item() == pytest.approx(math.log(2))


@pytest.mark.parametrize("bad", [-1, 1.5, 0.0, True, "15"])
def test_tokrag_rejects_a_bad_min_fusion_layer(bad):
    from tokrag_integrations.policies.tokrag import TokRAG

    with pytest.raises(ValueError, match="min_fusion_layer"):
        TokRAG(min_fusion_layer=bad)
