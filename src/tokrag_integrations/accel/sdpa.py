"""The few-query attention path ``tokrag_sdpa`` (CPU speed work).

With a KV cache and a mask (more than one new position, a left-padded batch, a cache with
rolled-back holes), transformers' SDPA path repeats the key/value heads for grouped-query
attention and torch falls back to its math kernel: a 2-token pass then costs about twice a
1-token step. :func:`few_query_attention` computes the same attention for up to
:data:`MAX_ROWS` query positions without repeating keys (one query per row: torch's flash
kernel with the mask and ``enable_gqa``, and in a left-padded batch each row over its own
keys only; several: the query heads grouped per key/value head) and delegates everything
else (prefill, no mask, CUDA, soft-capping, sinks) to transformers' SDPA function. It is
registered as the attention implementation ``"tokrag_sdpa"`` (SDPA's boolean masks) and set
by :func:`.install.maybe_install` on float32 CPU models unless ``Speed.cpu_kernels`` is ``off``.

A prefill that packs two contexts of one query into one sequence (the RAG prompt, then the
part of the pure prompt after the head both share: :data:`PACKED_PREFILL`) attends as two
causal products, one per context, instead of one product under a full mask.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import ACTIVE_TAP, attention_window
from .cpu_kernels import MAX_ROWS

ATTN_IMPLEMENTATION = "tokrag_sdpa"

#: Set around a packed prefill: ``(R, H)``, the sequence's first ``R`` positions are one
#: causal context and the rest a second one that also sees the first ``H`` positions (the
#: prompt head both share). The attention mask passed along says the same, so a path that
#: does not know this layout still computes it (slowly, as one masked product).
PACKED_PREFILL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tokrag_packed_prefill", default=None
)
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


#: Rows of a left-padded batch whose first keys lie within this many keys of each other (or
#: a quarter of the keys, if more) attend in one call, from the earliest of their first keys.
SEGMENT_KEYS = 64


def _pad_segments(starts: list[int], n_keys: int) -> list[tuple[int, int, int]]:
    """Consecutive rows of a left-padded batch in runs whose first attended keys are close
    (:data:`SEGMENT_KEYS`): ``(first row, end row, first key of the run)`` per run."""
    gap = max(SEGMENT_KEYS, n_keys // 4)
    segs = []
    a, lo, hi = 0, starts[0], starts[0]
    for r in range(1, len(starts)):
        x = starts[r]
        if max(hi, x) - min(lo, x) > gap:
            segs.append((a, r, lo))
            a, lo, hi = r, x, x
        else:
            lo, hi = min(lo, x), max(hi, x)
    segs.append((a, len(starts), lo))
    return segs


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
    active = ACTIVE_TAP.get()
    if active:
        _keep_queries(module, query, key, dropout, scaling, kwargs, active)
    packed = PACKED_PREFILL.get()
    if packed is not None and b == 1 and q == key.shape[2] and q > packed[0]:
        got = _packed_attention(module, query, key, value, dropout, scaling, kwargs, *packed)
        if got is not None:
            return got, None
    if (
        attention_mask is None
        or q > MAX_ROWS
        or not _plain_attention(module, query, key, dropout, kwargs)
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
    if q == 1 and b > MAX_SPLIT_ROWS:
        starts = _left_pad_starts(attention_mask)
        segs = _pad_segments(starts, key.shape[2]) if starts is not None else None
        if segs is not None and (len(segs) > 1 or segs[0][2] > 0):
            # Left padding only, in runs of rows that start close together (a fused batch is
            # all pure rows, then all RAG rows): each run attends from its own first key, so
            # the short rows do not read the padding up to the longest one.
            outs = []
            for a, e, lo in segs:
                m = None if all(x == lo for x in starts[a:e]) else attention_mask[a:e, :, :, lo:]
                outs.append(
                    F.scaled_dot_product_attention(
                        query[a:e], key[a:e, :, lo:], value[a:e, :, lo:],
                        attn_mask=m, scale=scale, enable_gqa=True,
                    )
                )
            return torch.cat(outs).transpose(1, 2).contiguous(), None
    if q == 1 or (b == 1 and attention_mask.dtype != torch.bool):
        # One query per row (a decode step of a padded or fused batch), or several queries of
        # one sequence under an additive mask (a packed two-context step): torch's CPU flash
        # kernel takes the mask and the key/value heads as they are, and reads each key once.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return _grouped_attention(query, key, value, attention_mask, scale)[0], None


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    r: int,
    head: int,
) -> torch.Tensor | None:
    """Attention of a packed two-context prefill (see :data:`PACKED_PREFILL`): positions
    ``< r`` causally over themselves, the rest over the first ``head`` positions and
    causally over themselves. Returns [1, N, H, hd], or None where the module attends in a
    way this does not compute (the caller then applies the mask as it is)."""
    if not _plain_attention(module, query, key, dropout, kwargs) or attention_window(module):
        return None
    hd = query.shape[-1]
    scale = scaling if scaling is not None else hd**-0.5
    n = query.shape[2]
    first = F.scaled_dot_product_attention(
        query[:, :, :r], key[:, :, :r], value[:, :, :r], is_causal=True, scale=scale, enable_gqa=True
    )
    tail = n - r
    k2 = torch.cat([key[:, :, :head], key[:, :, r:]], dim=2)
    v2 = torch.cat([value[:, :, :head], value[:, :, r:]], dim=2)
    mask = torch.ones(tail, head + tail, dtype=torch.bool, device=query.device)
    mask[:, head:] = torch.ones(tail, tail, dtype=torch.bool, device=query.device).tril_()
    second = F.scaled_dot_product_attention(
        query[:, :, r:], k2, v2, attn_mask=mask, scale=scale, enable_gqa=True
    )
    # [1, N, H, hd] in one copy (the flash kernel's outputs are [1, q, H, hd] in memory).
    return torch.cat([first.transpose(1, 2), second.transpose(1, 2)], dim=1)


def _plain_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict[str, Any]
) -> bool:
    """Whether this call is attention our CPU paths compute as written: on CPU, no dropout,
    whole query groups per key/value head, no soft-capping, position bias or sinks."""
    return not (
        query.device.type != "cpu"
        or dropout
        or query.shape[1] % key.shape[1]
        or kwargs.get("softcap") is not None
        or kwargs.get("position_bias") is not None
        or getattr(module, "sinks", None) is not None
    )


def _grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention with the query heads grouped per key/value head (no repeated keys).

    ``query`` [B, H, q, hd], ``key``/``value`` [B, Hkv, T, hd], ``attention_mask`` None or
    [B, 1, q, T] (bool or additive). Returns the output [B, q, H, hd] and the probabilities
    [B, Hkv, g, q, T] (query head i*g + j is ``[:, i, j]``; masked keys get 0)."""
    b, h, q, hd = query.shape
    hkv, t = key.shape[1], key.shape[2]
    g = h // hkv
    # Query head i*g + j reads key/value head i: group the g query heads of each key head.
    qg = query.reshape(b, hkv, g * q, hd)
    scores = torch.matmul(qg, key.transpose(-1, -2)).mul_(scale).view(b, hkv, g, q, t)
    if attention_mask is not None:
        mask = attention_mask[:, :, None]  # [B, 1, 1, q, T]
        if mask.dtype == torch.bool:
            # A row with no key at all (a padded query) gets finite scores, not NaN.
            scores = scores.masked_fill_(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores.add_(mask)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(probs.view(b, hkv, g * q, t), value)  # [B, Hkv, g*q, hd]
    return out.view(b, h, q, hd).transpose(1, 2).contiguous(), probs


def _keep_queries(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
    taps: tuple[Any, ...],
) -> None:
    """Leave each active probe's rows of this layer's rotated query (and its scaling) in its
    tap, so that an attention row read later is one ``q·K`` with the cached keys. Only for
    attention the recomputation reproduces (:func:`_plain_attention`, no sliding window)."""
    idx = getattr(module, "layer_idx", None)
    if idx is None or attention_window(module):
        return
    if not _plain_attention(module, query, key, dropout, kwargs):
        return
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    for tap in taps:
        if not 0 <= idx < len(tap.query):
            continue
        if tap.positions is not None:
            if query.shape[0] != 1:
                continue
            rows = query[0, :, tap.positions].transpose(0, 1)  # [rows, H, hd]
            if query.shape[2] > rows.shape[0] and isinstance(tap.positions, slice):
                rows = rows.clone()  # not a view keeping a whole prefill's queries alive
        else:
            rows = query[:, :, -1]
            if query.shape[2] > 1:
                rows = rows.clone()  # a prefill: keep the last position, not the whole pass
        tap.query[idx] = rows.detach()
        tap.scale[idx] = scale


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
