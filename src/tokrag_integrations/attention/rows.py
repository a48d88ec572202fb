"""Attention rows from the probe's states and the KV cache (Eq. 14-15), and the logit lens
(Eq. 13)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .parts import ModelParts, attention_window, query_projection
from .probe import ProbeRecord


def cached_keys(cache: Any, layer_idx: int) -> torch.Tensor:
    """Keys of one layer from a transformers cache: [B, kv_heads, T_kept, hd]."""
    return cache.layers[layer_idx].keys


def attention_row(
    parts: ModelParts,
    layer_idx: int,
    record: ProbeRecord,
    keys: torch.Tensor,
    key_valid: torch.Tensor,
    seen_len: int,
) -> torch.Tensor:
    """Head-wise attention probabilities of the last position at one layer.

    Recomputed from the cached (already rotated) keys and the query of the last position, so
    it equals the model's own attention without running eager attention.

    Args:
        parts: from :func:`model_parts`.
        layer_idx: 0-based layer index (layer l of the paper is ``layer_idx = l - 1``).
        record: probe record of the forward pass that produced the current position.
        keys: [B, kv_heads, T_kept, hd] cached keys of that layer (the last ``T_kept`` of
            ``seen_len`` positions when the layer uses a sliding window cache).
        key_valid: [B, seen_len] bool, False at padding positions.
        seen_len: number of positions the cache has seen (prompt + generated).

    Returns:
        [B, H, seen_len] attention probabilities (zeros at positions that are masked or no
        longer in a sliding window cache).
    """
    attn = parts.attn[layer_idx]
    bsz = keys.shape[0]
    head_dim = attn.head_dim
    q = query_projection(attn, record.attn_in[layer_idx])  # [B, H*hd]
    q_norm = getattr(attn, "q_norm", None)
    norm_weight = getattr(q_norm, "weight", None)
    if norm_weight is not None and norm_weight.shape[-1] == q.shape[-1] != head_dim:
        q, q_norm = q_norm(q), None  # OLMo 2: one norm over all heads, before the split
    q = q.view(bsz, -1, 1, head_dim)  # [B, H, 1, hd]
    if q_norm is not None:
        q = q_norm(q)  # Qwen3, Gemma 3: a norm per head
    cos = record.cos[layer_idx].unsqueeze(1)  # [B, 1, hd]
    sin = record.sin[layer_idx].unsqueeze(1)
    q, _ = parts.rotary_fns[layer_idx](q, q, cos, sin)
    n_heads, n_kv = q.shape[1], keys.shape[1]
    groups = n_heads // n_kv
    # Grouped-query attention without materialising repeated keys: [B, kv, groups, hd] @ [B, kv, hd, T].
    qg = q.view(bsz, n_kv, groups, head_dim).float()
    scores = torch.matmul(qg, keys.float().transpose(-1, -2)).reshape(bsz, n_heads, -1) * attn.scaling
    softcap = getattr(attn, "attn_logit_softcapping", None)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    kept = keys.shape[2]
    offset = seen_len - kept
    valid = key_valid[:, offset:seen_len].clone()
    window = attention_window(attn)
    if window:
        pos = torch.arange(offset, seen_len, device=valid.device)
        valid &= (seen_len - 1 - pos) < window
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if offset:
        probs = torch.nn.functional.pad(probs, (offset, 0))
    return probs


def attention_rows(
    parts: ModelParts,
    record: ProbeRecord,
    keys: list[torch.Tensor],
    key_valid: torch.Tensor,
    seen_len: int,
) -> torch.Tensor:
    """:func:`attention_row` for every layer of one row at once: [L, H, seen_len].

    The per-layer work is one query projection and one ``q·K``; scaling, masking and the
    softmax run once over all layers. Only for models whose layers attend alike (full
    attention, one rotary function, one scaling, no soft-capping, no q_norm); others go
    layer by layer (:func:`attention_row`), with the same numbers.

    Args: ``keys`` the cached keys of every layer, each [1, kv_heads, T, hd] with
    ``T >= seen_len``; ``key_valid`` [1, seen_len] bool.
    """
    attn = parts.attn
    first = attn[0]
    uniform = (
        all(not attention_window(a) for a in attn)
        and all(not getattr(a, "attn_logit_softcapping", None) for a in attn)
        and all(not hasattr(a, "q_norm") for a in attn)
        and len({getattr(a, "scaling", None) for a in attn}) == 1
        and len({id(f) for f in parts.rotary_fns}) == 1
        and all(k.shape[0] == 1 and k.shape[2] >= seen_len for k in keys)
    )
    if not uniform:
        return torch.stack(
            [
                attention_row(parts, i, record, keys[i][:, :, :seen_len], key_valid, seen_len)[0]
                for i in range(len(attn))
            ]
        )
    n_layers = len(attn)
    head_dim = first.head_dim
    x = record.attn_in[:, 0]  # [L, d]
    q = torch.stack([query_projection(attn[i], x[i : i + 1])[0] for i in range(n_layers)])  # [L, H*hd]
    q = q.view(n_layers, -1, 1, head_dim)  # [L, H, 1, hd]
    cos = torch.stack([c[0] for c in record.cos])[:, None]  # [L, 1, hd]
    sin = torch.stack([s_[0] for s_ in record.sin])[:, None]
    q, _ = parts.rotary_fns[0](q, q, cos, sin)
    return attention_from_queries(q[:, :, 0], [first.scaling] * n_layers, keys, key_valid, seen_len)


def attention_from_queries(
    queries: torch.Tensor | list[torch.Tensor],
    scales: list[float],
    keys: list[torch.Tensor],
    key_valid: torch.Tensor,
    seen_len: int,
) -> torch.Tensor:
    """Attention probabilities of one position at every layer from its rotated queries
    (``queries`` [L, H, hd], or a list of [H, hd]; ``scales`` each layer's scaling) and the
    cached keys (each [1, kv_heads, T, hd], ``T >= seen_len``) over the valid keys
    (``key_valid`` [1, seen_len] bool). Returns [L, H, seen_len] (zeros where not valid).
    Full attention without soft-capping, as :func:`attention_rows` computes it."""
    n_layers = len(keys)
    valid = key_valid[0, :seen_len]
    # Keys before the row's first valid one (left padding) are skipped, not just masked.
    start = int(valid.int().argmax()) if bool(valid.any()) else 0
    n_heads, head_dim = queries[0].shape
    n_kv = keys[0].shape[1]
    groups = n_heads // n_kv
    scores = torch.empty(n_layers, n_kv, groups, seen_len - start, device=keys[0].device)
    for i in range(n_layers):
        qg = queries[i].reshape(n_kv, groups, head_dim).float()
        torch.matmul(qg, keys[i][0, :, start:seen_len].float().transpose(-1, -2), out=scores[i])
    scores = scores.view(n_layers, n_heads, seen_len - start)
    if len(set(scales)) == 1:
        scores.mul_(scales[0])
    else:
        scores.mul_(torch.tensor(scales, dtype=scores.dtype, device=scores.device)[:, None, None])
    scores = scores.masked_fill_(~valid[None, None, start:], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.nn.functional.pad(probs, (start, 0)) if start else probs


def logit_lens(
    parts: ModelParts,
    resid: torch.Tensor,
    *,
    final_norm: bool = True,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """phi(h): logits read off any layer's residual state.

    ``final_norm=True`` applies the model's final norm before the LM head (the usual logit
    lens); ``False`` applies the LM head directly, as the authors' released code does.
    Input [..., d] -> output [..., V] (float32). ``product``: another way to multiply many
    rows [n, d] by the LM head (the engine passes the packed head of a decode whose ``Speed``
    asks for it: :func:`..accel.packed_head.packed_head`); None, or a single row: the head's
    own forward.
    """
    h = resid.to(parts.lm_head.weight.dtype)
    if final_norm:
        h = parts.final_norm(h)
    logits = None
    if h.dim() == 2 and h.shape[0] > 1 and product is not None:
        logits = product(h).float()  # it falls back to the head's forward below a few rows
    if logits is None:
        logits = parts.lm_head(h).float()
    if parts.logits_scaling:  # as the model's own head (Granite)
        logits = logits / parts.logits_scaling
    cap = parts.final_logit_softcap
    if cap:  # as the model's own head (Gemma 2): the lens of the last layer is its logits
        logits = torch.tanh(logits / cap) * cap
    return logits
