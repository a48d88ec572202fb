"""A model's parts as the probes read them: layers, attention modules, norms, head, rotary
functions, and the checks that a model has what Tok-RAG needs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelParts:
    """Handles on the pieces of a decoder-only model that the signals read."""

    layers: list[Any]
    embed: Any
    final_norm: Any
    lm_head: Any
    attn: list[Any]
    rotary_fns: list[Any]
    #: ``config.final_logit_softcapping`` (Gemma 2; None for most models): the model's logits
    #: are ``tanh(head(h) / c) * c``, and so are the logit lens's.
    final_logit_softcap: float | None = None
    #: ``config.logits_scaling`` (Granite; None for most models): the model's logits are
    #: ``head(h) / s``, and so are the logit lens's.
    logits_scaling: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embedding_matrix(self) -> torch.Tensor:
        """A: the input embedding matrix, rows = token ids."""
        return self.embed.weight


def attention_window(attn: Any) -> int | None:
    """The sliding window an attention module attends over, or None for full attention.

    Most modules carry it (Gemma 2/3, Qwen2: ``attn.sliding_window``, None on full layers);
    Mistral-style modules read ``config.sliding_window`` in their forward and apply it on
    every layer (their config has no ``layer_types``), so it is taken from there.
    """
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window or None
    cfg = getattr(attn, "config", None)
    if cfg is not None and getattr(cfg, "layer_types", None) is None:
        return getattr(cfg, "sliding_window", None) or None
    return None


def _has_query_projection(attn: Any) -> bool:
    return hasattr(attn, "q_proj") or (
        hasattr(attn, "qkv_proj") and hasattr(getattr(attn, "config", None), "num_attention_heads")
    )


def query_projection(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., H*hd]: an attention module's query projection of ``x`` (cast to the
    weight's dtype). A fused QKV projection laid out as [Q | K | V] (Phi-3's ``qkv_proj``)
    contributes its first ``H*hd`` outputs, as its forward slices them."""
    proj = getattr(attn, "q_proj", None)
    if proj is not None:
        return proj(x.to(proj.weight.dtype))
    qkv = attn.qkv_proj
    n = attn.config.num_attention_heads * attn.head_dim
    bias = None if qkv.bias is None else qkv.bias[:n]
    return torch.nn.functional.linear(x.to(qkv.weight.dtype), qkv.weight[:n], bias)


def _find_backbone(model: Any) -> Any:
    for name in ("model", "transformer", "language_model"):
        sub = getattr(model, name, None)
        if sub is not None and hasattr(sub, "layers"):
            return sub
        if sub is not None and hasattr(sub, "language_model"):
            return sub.language_model
    if hasattr(model, "layers"):
        return model
    return None


def model_parts(model: Any) -> ModelParts:
    """Locate layers, embeddings, final norm, LM head and attention modules.

    Raises:
        ValueError: the architecture does not expose what the signals read, with the fix.
    """
    cached = getattr(model, "_tokrag_parts", None)
    if cached is not None:
        return cached
    backbone = _find_backbone(model)
    why = None
    fused = {"query_key_value", "c_attn"}  # GPT-NeoX / Falcon, GPT-2: Q, K, V in one matrix
    if any(name.rsplit(".", 1)[-1] in fused for name, _ in model.named_modules()):
        why = "fused query/key/value projections (query_key_value / c_attn) with no query projection of their own"
    elif backbone is None:
        why = "no decoder layer list (model.model.layers)"
    else:
        layers = list(backbone.layers)
        attn = [getattr(layer, "self_attn", None) for layer in layers]
        embed = getattr(backbone, "embed_tokens", None)
        norm = getattr(backbone, "norm", None)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if any(a is None or not _has_query_projection(a) for a in attn):
            why = "attention modules without a q_proj or a [Q | K | V] qkv_proj"
        elif embed is None or norm is None or head is None:
            why = "no embed_tokens / final norm / LM head"
        else:
            rot = [getattr(sys.modules[type(a).__module__], "apply_rotary_pos_emb", None) for a in attn]
            if any(r is None for r in rot):
                why = "attention without rotary position embeddings"
    if why is not None:
        raise ValueError(
            f"{type(model).__name__}: the Tok-RAG signals cannot read this architecture ({why}). "
            "Use a decoder the matrix covers (Llama, SmolLM, Mistral, Qwen2/3, Gemma 2/3, Phi-3, "
            "OLMo 2, Granite), or load it "
            "with load_model(..., require_signals=False) for the 'rag'/'no_rag' policies, which "
            "need no signals."
        )
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    softcap = getattr(cfg, "final_logit_softcapping", None)
    logits_scaling = getattr(cfg, "logits_scaling", None)
    parts = ModelParts(
        layers=layers,
        embed=embed,
        final_norm=norm,
        lm_head=head,
        attn=attn,
        rotary_fns=rot,
        final_logit_softcap=float(softcap) if softcap else None,
        logits_scaling=float(logits_scaling) if logits_scaling not in (None, 1, 1.0) else None,
    )
    try:
        model._tokrag_parts = parts
    except Exception:  # pragma: no cover - exotic module types
        pass
    return parts


def check_supported(model: Any) -> None:
    """Raise a ValueError naming the fix when the signals cannot read ``model``."""
    model_parts(model)
