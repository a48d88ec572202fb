"""The model's forward on the static decode state (:mod:`.static_state`): one token per row
through the layers' own forwards, the keys and values written in place at the shared column
(:class:`StaticKV`), the attention of the position over the static columns
(:func:`static_attention`, registered with transformers as :data:`ATTN_STATIC`) leaving its
probabilities where a rule or a citation reads them."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTN_STATIC", "StaticKV", "register_attention", "static_attention", "static_forward"]


#: The attention implementation the step's layers run (registered with transformers): the
#: attention of one query position over the static columns, leaving its probabilities.
ATTN_STATIC = "tokrag_static"


def static_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    tokrag_probs: list[torch.Tensor] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of the step's query positions ([B, H, q, hd]) over the static keys and
    values ([B, kv_heads, C, hd]) where ``attention_mask`` ([B, 1, q, C] bool) is True.
    With ``tokrag_probs`` (a list) the probabilities are computed in float32 and the last
    position's [B, H, C] appended to it (grouped-query attention without repeating the
    keys); without, one fused ``scaled_dot_product_attention``."""
    bsz, n_heads, q_len, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    if tokrag_probs is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    n_kv = key.shape[1]
    groups = n_heads // n_kv
    qg = query.reshape(bsz, n_kv, groups * q_len, head_dim).float()
    scores = torch.matmul(qg, key.float().transpose(-1, -2)) * scale  # [B, kv, g*q, C]
    scores = scores.view(bsz, n_heads, q_len, -1)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    tokrag_probs.append(probs[:, :, -1])
    out = torch.matmul(probs.view(bsz, n_kv, groups * q_len, -1).to(value.dtype), value)
    return out.view(bsz, n_heads, q_len, head_dim).transpose(1, 2).contiguous(), None


_REGISTERED = False


def register_attention() -> None:
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_STATIC, static_attention)
        _REGISTERED = True


class StaticKV:
    """The cache the step's layers write: ``update`` puts the new key/value column at the
    shared column ``col`` (index_copy_, in place) and returns the whole buffers."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], col: torch.Tensor):
        self.keys, self.values, self.col = keys, values, col

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *a: Any, **k: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kb, vb = self.keys[layer_idx], self.values[layer_idx]
        kb.index_copy_(2, self.col, key_states)
        vb.index_copy_(2, self.col, value_states)
        return kb, vb


def static_forward(
    model: Any,
    ids: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    col: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    *,
    resid: bool,
    attn: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One token per row through ``model`` on the static state: ([R, V] float32 logits,
    [R, L+1, d] residuals at the position or None, [R, L, H, C] attention probabilities or
    None). The layers' own forwards run (their attention is :func:`static_attention`, the
    model's ``_attn_implementation`` while the step runs)."""
    backbone = model.model
    x = backbone.embed_tokens(ids[:, None])
    mask = valid[:, None, None, :]
    position_ids = pos[:, None]
    pe = backbone.rotary_emb(x, position_ids=position_ids)
    cache = StaticKV(keys, values, col.view(1))
    probs: list[torch.Tensor] | None = [] if attn else None
    states = [x[:, 0]] if resid else []
    for layer in backbone.layers:
        # The class's forward: the probe's taps (an instance attribute) are not needed here.
        x = type(layer).forward(
            layer,
            x,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            position_embeddings=pe,
            tokrag_probs=probs,
        )
        if resid:
            states.append(x[:, 0])
    h = backbone.norm(x[:, 0])
    logits = model.lm_head(h).float()
    return (
        logits,
        torch.stack(states, dim=1) if resid else None,
        torch.stack(probs, dim=1) if probs is not None else None,
    )
