"""Tok-RAG signals as pure tensor functions (paper Sections 3.1–3.2, Eq. 13–19).

Every function takes tensors and returns tensors or numbers, so each is tested on hand-made
inputs with known answers. Layer indices follow the paper: l = 1..L, with l = 0 the
embeddings; arrays indexed by layer have index ``l - 1`` for layer l unless noted.
"""

from __future__ import annotations

import math

import torch

#: Eq. 14 threshold on the per-vocabulary-entry scale (paper: a = 5e-7; the authors' code
#: averages JSD over the vocabulary, so the summed JSD is compared with a * |V|).
DEFAULT_JSD_THRESHOLD = 5e-7


def _check_dist(p: torch.Tensor, name: str) -> None:
    if p.dim() < 1 or p.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(p.shape)}")


def jsd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in nats over the last dim, 0.5·KL(p‖m) + 0.5·KL(q‖m), in
    [0, ln 2]. Shapes [..., V] -> [...]."""
    _check_dist(p, "p")
    if p.shape != q.shape:
        raise ValueError(
            f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    p, q = p.float(), q.float()
    # xlogy gives 0·log 0 = 0; the clamp keeps m > 0 where half a subnormal p rounds to 0.
    m = (0.5 * (p + q)).clamp_min_(torch.finfo(torch.float32).tiny)
    kl_pm = (torch.xlogy(p, p) - torch.xlogy(p, m)).sum(-1)
    kl_qm = (torch.xlogy(q, q) - torch.xlogy(q, m)).sum(-1)
    return (0.5 * kl_pm + 0.5 * kl_qm).clamp_min(0.0)


def layer_shift_jsd_logp(lens_logp: torch.Tensor) -> torch.Tensor:
    """JSD(φ(h^{l-1}), φ(h^l)) for l = 1..L from log-probabilities, with one logarithm per
    entry (of the mixture): KL(p‖m) = Σ p·(log p − log m). Input [..., L+1, V] (leading
    dimensions: several contexts at once) -> output [..., L]."""
    if lens_logp.dim() < 2 or lens_logp.shape[-2] < 2:
        raise ValueError(
            f"lens_logp must be [..., L+1, V] with L >= 1, got {tuple(lens_logp.shape)}"
        )
    _check_dist(lens_logp, "lens_logp")
    logp = lens_logp.float()
    probs = logp.exp()
    logp, logq, p, q = logp[..., :-1, :], logp[..., 1:, :], probs[..., :-1, :], probs[..., 1:, :]
    # m > 0 wherever p or q is; the clamp only keeps 0·log 0 from becoming NaN.
    logm = (0.5 * (p + q)).clamp_min_(torch.finfo(torch.float32).tiny).log_()
    kl = (p * (logp - logm)).sum(-1) + (q * (logq - logm)).sum(-1)
    return (0.5 * kl).clamp_min(0.0)


def distribution_change_gap(rag_shift: torch.Tensor, pure_shift: torch.Tensor) -> torch.Tensor:
    """g(l) of Eq. 13: |JSD shift in the RAG context − JSD shift in the pure context|, [L]."""
    return (rag_shift - pure_shift).abs()


def retrieved_attention_mass(attn_probs: torch.Tensor, rt_positions: torch.Tensor) -> torch.Tensor:
    """f(l): attention mass on the retrieved positions ``rt_positions`` [m], averaged over
    heads: [L, H, T] last-position attention probabilities -> [L]."""
    return attn_probs.index_select(-1, rt_positions).sum(-1).mean(-1)


def fusion_layer(
    f: torch.Tensor,
    g: torch.Tensor,
    *,
    vocab_size: int,
    threshold: float = DEFAULT_JSD_THRESHOLD,
    min_fusion_layer: int = 0,
) -> tuple[int, int, int]:
    """l* of Eq. 14 = floor((argmax_l f(l) + min{l : g(l) > a}) / 2).

    ``f`` and ``g`` are [L] with index ``l - 1`` for layer l; ``g`` is compared with
    ``threshold * vocab_size`` (a is per vocabulary entry) and may be shorter than ``f``.
    Layers below ``min_fusion_layer`` are not searched; with no crossing the second term is L.
    Returns (l*, argmax layer of f, first crossing layer of g), all 1-based.
    """
    n_layers = f.shape[0]
    if n_layers == 0:
        raise ValueError("f must cover at least one layer")
    if not 0 <= min_fusion_layer <= n_layers:
        raise ValueError(f"min_fusion_layer must be in [0, {n_layers}], got {min_fusion_layer}")
    lo = max(1, min_fusion_layer)
    f_arg = lo + int(torch.argmax(f[lo - 1 :]).item())
    g_first = first_crossing(g, threshold * vocab_size, start_layer=lo)
    if g_first is None:
        g_first = n_layers
    return (f_arg + g_first) // 2, f_arg, g_first


def first_crossing(g: torch.Tensor, bound: float, *, start_layer: int = 1) -> int | None:
    """Smallest 1-based layer l >= start_layer with g(l) > bound, or None."""
    if g.shape[0] < start_layer:
        return None
    hits = torch.nonzero(g[start_layer - 1 :] > bound)
    return None if hits.numel() == 0 else start_layer + int(hits[0, 0].item())


def renormalised_attention(attn_probs: torch.Tensor, rt_positions: torch.Tensor) -> torch.Tensor:
    """Att of Eq. 15 at one layer: per head, attention over the retrieved positions
    renormalised to sum to 1 (the paper's softmax runs over R only), then averaged over heads:
    [H, T] and [m] positions -> [m]."""
    sub = attn_probs.index_select(-1, rt_positions)
    total = sub.sum(-1, keepdim=True)
    per_head = torch.where(total > 0, sub / total.clamp_min(1e-30), 1.0 / sub.shape[-1])
    return per_head.mean(0)


#: Where the l* search of Eq. 14 starts, as a fraction of the depth L: L/2 by default; the
#: authors' code searches above layer 10 of 32 (``min_fusion_layer=0.3125``).
DEFAULT_FUSION_FRACTION = 0.5
SHALLOW_STAGE_FRACTION = 10 / 32


def default_min_fusion_layer(num_layers: int, fraction: float = DEFAULT_FUSION_FRACTION) -> int:
    """Start of the l* search (Eq. 14): round(L·fraction), at least layer 1 (the shallow
    layers are not searched: docs/algorithm.md, "Eq. 14")."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return max(1, round(num_layers * fraction))


def plausible_tokens(final_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """DoLa's adaptive plausibility set: p_final(v) >= alpha · max_v p_final(v). [..., V] log
    p_final (one distribution or several rows) -> [..., V] bool."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"plausibility alpha must be in (0, 1], got {alpha}")
    return final_logp >= final_logp.amax(-1, keepdim=True) + math.log(alpha)


def rising_token(
    final_logp: torch.Tensor, fusion_logp: torch.Tensor, *, alpha: float | None = 0.1
) -> int:
    """x^{l'−l*}: the token whose log-probability rises most from layer l* to the final layer,
    log φ(h~^L) − log φ(h~^{l*}) (DoLa's layer contrast, docs/algorithm.md, "Eq. 15"), over the
    tokens plausible under the final distribution (:func:`plausible_tokens`; ``alpha=None``:
    the whole vocabulary, the literal reading)."""
    rise = final_logp.float() - fusion_logp.float()
    if alpha is not None:
        rise = rise.masked_fill(~plausible_tokens(final_logp.float(), alpha), float("-inf"))
    return int(torch.argmax(rise).item())


def word_similarity(
    embeddings: torch.Tensor, token_id: int, rt_token_ids: torch.Tensor
) -> torch.Tensor:
    """WordSim of Eq. 15: softmax_j (A[x] · A[rt_j]). Returns [m]."""
    a = embeddings.float()
    return torch.softmax(a[rt_token_ids] @ a[token_id], dim=-1)


def retrieval_distribution(
    att: torch.Tensor, wordsim: torch.Tensor, *, pr_norm: str = "sum"
) -> torch.Tensor:
    """p_R of Eq. 16 over the retrieved positions from Att ⊙ WordSim: ``"softmax"`` the
    paper's (nearly uniform: both factors lie in [0, 1]), ``"sum"`` the product over its sum."""
    prod = att * wordsim
    if pr_norm == "softmax":
        return torch.softmax(prod, dim=-1)
    if pr_norm == "sum":
        total = prod.sum()
        if total <= 0:
            return torch.full_like(prod, 1.0 / prod.numel())
        return prod / total
    raise ValueError(f"pr_norm must be 'sum' or 'softmax', got {pr_norm!r}")


def positions_to_vocab(
    p_r: torch.Tensor, rt_token_ids: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Map p_R over positions onto the vocabulary (repeated tokens add up). Returns [V]."""
    out = torch.zeros(vocab_size, dtype=p_r.dtype, device=p_r.device)
    return out.index_add_(0, rt_token_ids, p_r)


def retrieval_embedding(
    embeddings: torch.Tensor, p_r: torch.Tensor, rt_token_ids: torch.Tensor
) -> torch.Tensor:
    """w_IR = Σ_j p_R(j) · A[rt_j]."""
    return p_r.float() @ embeddings[rt_token_ids].float()


def weighted_embedding(
    probs: torch.Tensor, embeddings: torch.Tensor, *, top_k: int | None = None
) -> torch.Tensor:
    """w = Σ_v p(v)·A[v] / Σ_v p(v), optionally over the top-k tokens only (Sec. 3.2).

    Args: probs [V] or [N, V] (non-negative; N distributions share one read of A);
    embeddings [V, d]; top_k None = full vocabulary. Returns [d] or [N, d].
    """
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be a positive int or None, got {top_k}")
        vals, idx = torch.topk(probs.float(), min(top_k, probs.shape[-1]), dim=-1)
        emb = embeddings[idx].float()  # [..., k, d]
        return (vals.unsqueeze(-2) @ emb).squeeze(-2) / vals.sum(-1, keepdim=True)
    p = probs.float()
    return (p @ embeddings.float()) / p.sum(-1, keepdim=True)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).item())


def benefit_wins(cos_ir: float, cos_llm: float, threshold: float = 0.0) -> bool:
    """Eq. 19: benefit wins iff cos(w_RAG, w_IR) − cos(w_RAG, w_LLM) >= threshold (the paper:
    0; Theorem 2 only orders the margin)."""
    if math.isnan(cos_ir) or math.isnan(cos_llm):
        raise ValueError("cosine similarities must not be NaN")
    return cos_ir - cos_llm >= threshold


def restricted_jsd(p: torch.Tensor, q: torch.Tensor, support: torch.Tensor) -> float:
    """JSD of p and q restricted to the token ids ``support`` and renormalised there."""
    ps, qs = p.float()[support], q.float()[support]
    ps = ps / ps.sum().clamp_min(1e-30)
    qs = qs / qs.sum().clamp_min(1e-30)
    return float(jsd(ps, qs).item())


def distribution_scores(
    p_rag: torch.Tensor, p_llm: torch.Tensor, p_r_vocab: torch.Tensor, *, support_k: int = 10
) -> tuple[float, float]:
    """Theorem 3 on the distributions (Eq. 12): benefit − detriment grows with
    Sim(p_RAG, p_R) − Sim(p_RAG, p_LLM), Sim = −JSD over the union of the three
    distributions' top-``support_k`` tokens (each renormalised there). Returns
    (JSD(p_RAG, p_R), JSD(p_RAG, p_LLM)); benefit wins iff the first is not larger."""
    k = min(support_k, p_rag.shape[-1])
    support = torch.unique(
        torch.cat([torch.topk(x.float(), k).indices for x in (p_rag, p_llm, p_r_vocab)])
    )
    return restricted_jsd(p_rag, p_r_vocab, support), restricted_jsd(p_rag, p_llm, support)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats over the last dim."""
    p = probs.double()
    return -torch.where(p > 0, p * torch.log(p), 0.0).sum(-1)
