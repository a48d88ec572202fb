"""Faster CPU paths for the few-row work of decoding: linear layers and attention.

Linear layers
-------------

Decoding multiplies a few rows (one token per step, ``k`` tokens in a blockwise verifier
pass, a few dozen rows in a logit lens) by every weight matrix of the model. On the CPUs
measured here, torch's ``F.linear`` (``x @ W.T``, MKL sgemm with a transposed B) is slow for
such shapes: at 1 row it streams the weights at about a third of the memory bandwidth, and at
2 or 3 rows it is 1.5-2 times slower than at 1 row, while ``W @ x.T`` (the same product,
transposed, so the weight is read row by row as stored) runs at close to the bandwidth for
any row count from 2 on. One row is duplicated to take that path.

:func:`install` swaps the ``forward`` of a model's ``nn.Linear`` modules for one that takes
the transposed product when a call has at most :data:`MAX_ROWS` rows, and ``F.linear``
otherwise (prefill). It is applied by :func:`..models.load_model` to float32 models on CPU
after checking, on the model's own LM head, that it is faster on this machine
(``TOKRAG_CPU_KERNELS=auto|on|off`` overrides). The numbers are those of the same dot
products summed in a different order (differences in the last bits, as between any two BLAS
kernels).

Attention
---------
With a KV cache and a mask (more than one new position, a left-padded batch, a cache with
rolled-back holes), transformers' SDPA path repeats the key/value heads for grouped-query
attention and torch falls back to its math kernel: on this CPU a 2-token pass then costs
about twice a 1-token step. :func:`few_query_attention` computes the same attention for up
to :data:`MAX_ROWS` query positions without repeating keys (one query per row: torch's flash
kernel with the mask and ``enable_gqa``; several: the query heads grouped per key/value
head) and delegates everything else (prefill, no mask, CUDA, soft-capping, sinks)
to transformers' SDPA function. It is registered as the attention implementation
``"tokrag_sdpa"`` (SDPA's boolean masks) and set by :func:`maybe_install` together with the
linear path.
"""

from __future__ import annotations

import os
import time
import types
from typing import Any

import torch
import torch.nn.functional as F

#: Calls with more rows than this use ``F.linear`` (GEMM-shaped work, e.g. prefill).
MAX_ROWS = 64
#: Below this many output features a one-row call keeps ``F.linear`` (tiny matrices, where
#: duplicating the row costs more than it saves).
MIN_FEATURES_ONE_ROW = 512

_ATTR = "_tokrag_skinny"


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` for few rows."""
    k = x.shape[-1]
    n = weight.shape[0]
    m = x.numel() // k if k else 0
    if m == 0 or m > MAX_ROWS or (m == 1 and n < MIN_FEATURES_ONE_ROW):
        return F.linear(x, weight, bias)
    # Row-major rows in, row-major rows out: MKL's fast path here is W (as stored) times a
    # transposed row-major block; a column-major operand takes a path ~5x slower.
    x2 = x.reshape(m, k).contiguous()
    if m == 1:
        x2 = torch.cat([x2, x2])
    out = torch.mm(weight, x2.t())[:, :m].t().contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Use :func:`skinny_linear` in every ``nn.Linear`` of ``model``; returns how many."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and not getattr(mod, _ATTR, False):
            mod.forward = types.MethodType(_forward, mod)
            setattr(mod, _ATTR, True)
            n += 1
    return n


def uninstall(model: torch.nn.Module) -> int:
    """Undo :func:`install`."""
    n = 0
    for mod in model.modules():
        if getattr(mod, _ATTR, False):
            del mod.forward
            setattr(mod, _ATTR, False)
            n += 1
    return n


def installed(model: torch.nn.Module) -> bool:
    return any(getattr(m, _ATTR, False) for m in model.modules())


def _time(fn: Any, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def is_faster(weight: torch.Tensor, rows: tuple[int, ...] = (1, 3), reps: int = 3) -> bool:
    """Whether :func:`skinny_linear` beats ``F.linear`` on ``weight`` for these row counts
    (best of ``reps`` timings each; about 0.1 s for a 50k-row LM head)."""
    with torch.inference_mode():
        gain = 0.0
        for m in rows:
            x = torch.randn(m, weight.shape[1], dtype=weight.dtype)
            base = _time(lambda x=x: F.linear(x, weight), reps)
            fast = _time(lambda x=x: skinny_linear(x, weight, None), reps)
            gain += base - fast
    return gain > 0


ATTN_IMPLEMENTATION = "tokrag_sdpa"
#: One-query batches up to this many rows attend row by row when the mask is left padding.
MAX_SPLIT_ROWS = 4

# (mask, starts) of the last mask seen; replaced as one tuple so threads never mix two.
_pad_cache: tuple[torch.Tensor | None, list[int] | None] = (None, None)


def _left_pad_starts(mask: torch.Tensor) -> list[int] | None:
    """Per row, the first attended key of a [B, 1, 1, T] boolean mask that is left padding
    only (False..False True..True), else None. Computed once per forward pass: every layer
    gets the same mask tensor."""
    global _pad_cache
    if mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    cached_mask, cached = _pad_cache
    if cached_mask is mask:
        return cached
    m = mask[:, 0, 0, :]
    starts_t = (~m).sum(-1)
    expected = torch.arange(m.shape[-1], device=m.device)[None, :] >= starts_t[:, None]
    ok = torch.equal(m, expected) and bool((starts_t < m.shape[-1]).all())
    starts = [int(x) for x in starts_t] if ok else None
    _pad_cache = (mask, starts)
    return starts


def few_query_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for a few query positions against a cache, with a mask, on CPU.

    ``query`` [B, H, q, hd], ``key``/``value`` [B, Hkv, T, hd], ``attention_mask`` SDPA's
    [B, 1, q, T] (bool, True = attend, or additive float). Returns ([B, q, H, hd], None),
    as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, hd = query.shape
    hkv = key.shape[1]
    if (
        attention_mask is None
        or q > MAX_ROWS
        or query.device.type != "cpu"
        or dropout
        or h % hkv
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or getattr(module, "sinks", None) is not None
        or attention_mask.dim() != 4
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = scaling if scaling is not None else hd**-0.5
    if q == 1 and b <= MAX_SPLIT_ROWS:
        starts = _left_pad_starts(attention_mask)
        if starts is not None:
            # Left padding only (a fused pure+RAG batch): each row attends to its own keys,
            # so a short row does not pay for the padding up to the longest one.
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        query[r : r + 1],
                        key[r : r + 1, :, s_:],
                        value[r : r + 1, :, s_:],
                        scale=scale,
                        enable_gqa=True,
                    )
                    for r, s_ in enumerate(starts)
                ]
            )
            return out.transpose(1, 2).contiguous(), None
    if q == 1:
        # One query per row (a decode step of a padded or fused batch): torch's CPU flash
        # kernel takes the mask and the key/value heads as they are.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    g = h // hkv
    t = key.shape[2]
    # Query head i*g + j reads key/value head i: group the g query heads of each key head.
    qg = query.reshape(b, hkv, g * q, hd)
    scores = torch.matmul(qg, key.transpose(-1, -2)).mul_(scale).view(b, hkv, g, q, t)
    mask = attention_mask[:, :, None]  # [B, 1, 1, q, T]
    if mask.dtype == torch.bool:
        # A row with no key at all (a padded query) gets finite scores, not NaN.
        scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, t), value)  # [B, Hkv, g*q, hd]
    return out.view(b, h, q, hd).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, few_query_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)


def install_attention(model: Any) -> bool:
    """Use :func:`few_query_attention` in ``model`` when it runs SDPA now; returns whether."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True


def maybe_install(model: Any) -> bool:
    """Install both paths on a float32 CPU model when ``TOKRAG_CPU_KERNELS`` allows and the
    linear path is faster here (the attention path goes with it).

    ``TOKRAG_CPU_KERNELS``: ``auto`` (default: measure on the LM head), ``on`` or ``off``.
    """
    mode = os.environ.get("TOKRAG_CPU_KERNELS", "auto").strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"TOKRAG_CPU_KERNELS must be 'auto', 'on' or 'off', got {mode!r}")
    if mode == "off":
        return False
    try:
        p = next(model.parameters())
    except StopIteration:
        return False
    if p.device.type != "cpu" or p.dtype != torch.float32:
        return False
    if mode == "auto":
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        w = getattr(head, "weight", None)
        if w is None or not is_faster(w.detach()):
            return False
    install_attention(model)
    return install(model) > 0
