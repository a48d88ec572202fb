"""The model's forward on the static decode state (:mod:`.static_state`): one token per row
through the layers, the keys and values written in place at the shared column
(:class:`StaticKV`), the attention of the position over the static columns
(:func:`static_attention`, registered with transformers as :data:`ATTN_STATIC`) leaving its
probabilities where a rule or a citation reads them.

Two ways through a layer, the same operations in the same order (bit-equal outputs): the
layer's own forward (its modules called as modules), or, for the decoder layers of
:data:`DIRECT_LAYERS` (:func:`direct_off_reason`), :func:`_direct_layer`: the same block
written out, each leaf module's own ``forward`` called directly. A token's step is some 400
small module calls on a small model, and the host time of the call machinery (hooks,
keyword plumbing, deprecation wrappers, the attention lookup) is about a fifth of the step
on CPU: Hugging Face ``generate`` pays it, the static step need not."""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers.models.llama.modeling_llama import rotate_half

from ..contexts.kv_cache import has_sliding_window

__all__ = [
    "ATTN_STATIC",
    "DIRECT_LAYERS",
    "STATIC_ARCHITECTURES",
    "StaticKV",
    "direct_off_reason",
    "register_attention",
    "static_attention",
    "static_forward",
    "static_off_reason",
]

#: Architectures whose forward :func:`static_forward` reproduces (the decoder layers of
#: Llama / SmolLM, Mistral, Qwen2 and Qwen3 with full attention: embeddings, rotary
#: embedding, layers, final norm, head; no multipliers, no soft-capping).
STATIC_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

#: Decoder layers :func:`_direct_layer` reproduces: the pre-norm block of Llama, Mistral,
#: Qwen2 and Qwen3 (q_proj / k_proj / v_proj / o_proj, rotary, RMSNorms, gated MLP; Qwen3's
#: per-head q_norm / k_norm), with the MLPs of :data:`DIRECT_MLPS`.
DIRECT_LAYERS = frozenset(
    {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
)
DIRECT_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


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
    values ([B, kv_heads, C, hd]); ``attention_mask`` ([B, 1, q, C]) is additive (0 where a
    column is seen, -inf where not, in the query's dtype: :func:`static_forward` builds it
    once a step, so no layer converts a boolean mask) or bool (True where seen).
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
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    elif attention_mask is not None:  # + 0 keeps a score exactly, + -inf masks it
        scores = scores + attention_mask
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


def _hooked(module: Any) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or getattr(module, "_forward_pre_hooks_with_kwargs", None)
    )


def static_off_reason(lm: Any, policy: Any) -> str | None:
    """Why ``policy`` (a :class:`...policies.base.Policy`) on ``lm`` (a loaded model) cannot be
    decoded on the static state, or None."""
    model = lm.model
    kind = getattr(model.config, "model_type", None)
    if kind not in STATIC_ARCHITECTURES:
        return f"architecture {kind!r}: the static step covers {', '.join(sorted(STATIC_ARCHITECTURES))}"
    if has_sliding_window(model):
        return "sliding-window attention: the static step covers full attention only"
    backbone = getattr(model, "model", None)
    if not all(hasattr(backbone, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "no embed_tokens / layers / norm / rotary_emb on model.model"
    if getattr(model.config, "final_logit_softcapping", None):
        return "final logit soft-capping"
    if any(r not in ("pure", "rag") for r in policy.roles):
        return f"policy {policy.name!r} decodes contexts other than pure / rag / passage:j"
    return None


def direct_off_reason(model: Any) -> str | None:
    """Why :func:`static_forward` must call ``model``'s layers as modules (None: it may write
    them out, :func:`_direct_layer`): a layer or MLP class outside :data:`DIRECT_LAYERS` /
    :data:`DIRECT_MLPS`, a part missing, a forward hook (a module call would run it), or the
    kernels hub loaded (its layers may replace the stock forwards)."""
    if "kernels" in sys.modules:
        return "the kernels hub is loaded"
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "a global forward hook"
    for layer in model.model.layers:
        kind = type(layer).__name__
        if kind not in DIRECT_LAYERS:
            return f"decoder layer {kind}"
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or not all(hasattr(a, n) for n in _ATTN_PARTS):
            return f"{kind}: attention without {', '.join(_ATTN_PARTS)}"
        if type(mlp).__name__ not in DIRECT_MLPS or not all(hasattr(mlp, n) for n in _MLP_PARTS):
            return f"{kind}: MLP {type(mlp).__name__}"
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm")):
            return f"{kind}: no input / post-attention norm"
    if any(_hooked(m) for m in model.modules()):
        return "a forward hook on the model"
    return None


def _direct_layer(
    layer: Any,
    i: int,
    x: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: StaticKV,
    probs: list[torch.Tensor] | None,
) -> torch.Tensor:
    """One decoder layer of :data:`DIRECT_LAYERS` on ``x`` [B, 1, d], as its forward computes
    it (norm, q/k/v projections with Qwen3's per-head norms, the rotary embedding ``(q * cos)
    + (rotate_half(q) * sin)`` with transformers' ``rotate_half`` and ``cos`` / ``sin``
    [B, 1, 1, hd], the key / value column written, :func:`static_attention`, o_proj, residual; norm, ``down(act(gate(h)) * up(h))``,
    residual), each leaf module's ``forward`` called directly (an installed CPU kernel, an
    instance attribute, still runs)."""
    a, mlp = layer.self_attn, layer.mlp
    bsz = x.shape[0]
    shape = (bsz, x.shape[1], -1, a.head_dim)
    residual = x
    h = layer.input_layernorm.forward(x)
    q = a.q_proj.forward(h).view(shape)
    k = a.k_proj.forward(h).view(shape)
    v = a.v_proj.forward(h).view(shape).transpose(1, 2)
    q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
    if q_norm is not None and k_norm is not None:  # Qwen3
        q, k = q_norm.forward(q), k_norm.forward(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = (q * cos) + (rotate_half(q) * sin)  # transformers' apply_rotary_pos_emb, cos
    k = (k * cos) + (rotate_half(k) * sin)  # / sin unsqueezed once a step, not per layer
    kb, vb = cache.update(k, v, i)
    out, _ = static_attention(a, q, kb, vb, mask, scaling=a.scaling, tokrag_probs=probs)
    out = a.o_proj.forward(out.reshape(bsz, x.shape[1], -1).contiguous())
    x = residual + out
    residual = x
    h = layer.post_attention_layernorm.forward(x)
    h = mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
    return residual + h


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
    direct: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One token per row through ``model`` on the static state: ([R, V] float32 logits,
    [R, L+1, d] residuals at the position or None, [R, L, H, C] attention probabilities or
    None). ``direct`` (where :func:`direct_off_reason` is None): every layer written out
    (:func:`_direct_layer`); else the layers' own forwards run (their attention is
    :func:`static_attention`, the model's ``_attn_implementation`` while the step runs)."""
    backbone = model.model
    x = backbone.embed_tokens(ids[:, None])
    # The additive mask every layer's attention reads (0 / -inf): built once here, where a
    # boolean one would be converted again by each layer's scaled_dot_product_attention.
    mask = torch.where(valid, 0.0, float("-inf")).to(x.dtype)[:, None, None, :]
    position_ids = pos[:, None]
    pe = backbone.rotary_emb(x, position_ids=position_ids)
    cos, sin = pe[0].unsqueeze(1), pe[1].unsqueeze(1)
    cache = StaticKV(keys, values, col.view(1))
    probs: list[torch.Tensor] | None = [] if attn else None
    states = [x[:, 0]] if resid else []
    for i, layer in enumerate(backbone.layers):
        if direct:
            x = _direct_layer(layer, i, x, mask, cos, sin, cache, probs)
        else:
            # The class's forward: the probe's taps (an instance attribute) are not needed.
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
