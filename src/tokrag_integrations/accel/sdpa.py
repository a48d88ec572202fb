"""The few-query attention path ``tokrag_sdpa`` (CPU speed work).

With a KV cache and a mask (a left-padded batch, several new positions), transformers' SDPA
path repeats the key/value heads for grouped-query attention and torch falls back to its
math kernel. :func:`few_query_attention` computes the same attention for up to
:data:`MAX_ROWS` query positions without repeating keys (one query per row: torch's flash
kernel with the mask and ``enable_gqa``; several: the query heads grouped per key/value
head) and delegates everything else (prefill, no mask, CUDA, soft-capping, sinks) to
transformers' SDPA function. It is
registered as the attention implementation ``"tokrag_sdpa"`` (SDPA's boolean masks) and set
by :func:`.install.maybe_install` on float32 CPU models unless ``Speed.cpu_kernels`` is ``off``
(a decode with ``off`` on a model that has it runs transformers' SDPA:
:func:`.cpu_kernels.stock_kernels`).

A prefill that packs two contexts of one query into one sequence (the RAG prompt, then the
part of the pure prompt after the head both share: :data:`PACKED_PREFILL`) attends as two
causal products, one per context, instead of one product under a full mask.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any

import torch
import torch.nn.functional as F

from ..attention.parts import attention_window
from ..attention.probe import ACTIVE_TAP
from .cpu_kernels import MAX_ROWS, stock

ATTN_IMPLEMENTATION = "tokrag_sdpa"

#: Set around a packed prefill: ``(R, H)``, the sequence's first ``R`` positions are one
#: causal context and the rest a second one that also sees the first ``H`` positions (the
#: prompt head both share). The attention mask passed along says the same, so a path that
#: does not know this layout still computes it (slowly, as one masked product).
PACKED_PREFILL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tokrag_packed_prefill", default=None
)


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

    if stock():  # a decode asking for the stock paths (``Speed.cpu_kernels`` off)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
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
    runs = _key_runs(attention_mask, key.shape[2]) if q == 1 and b > 1 else None
    if runs is not None:
        # Rows of very different lengths (a fused batch: short pure rows beside long RAG
        # rows, all left-padded to the longest): each run of rows attends from the first key
        # any of its rows sees, not over the padding of the others.
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[a:e],
                    key[a:e, :, s:],
                    value[a:e, :, s:],
                    attn_mask=attention_mask[a:e, :, :, s:],
                    scale=scale,
                    enable_gqa=True,
                )
                for a, e, s in runs
            ]
        )
        return out.transpose(1, 2).contiguous(), None
    if q == 1 or (b == 1 and attention_mask.dtype != torch.bool):
        # One query per row (a decode step of a padded or fused batch), or several queries of
        # one sequence under an additive mask (a packed two-context step): torch's CPU flash
        # kernel takes the mask and the key/value heads as they are, and reads each key once.
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    return _grouped_attention(query, key, value, attention_mask, scale), None


#: One more attention call per step costs about this many (row, key) pairs of the product
#: (a flash call on a few rows of SmolLM2's shape, measured on the 2-core EPYC VM: ~0.13 us a
#: pair, ~20 us a call); a run of rows is split off only where it saves more.
RUN_CALL_COST = 256
#: The last mask seen by :func:`_key_runs` in this thread, and its runs: every layer of one
#: forward pass gets the same mask object (transformers builds it per pass from the batch's 2D
#: mask), so the runs are found once per step.
_RUNS = threading.local()


def _key_runs(mask: torch.Tensor, t: int) -> list[tuple[int, int, int]] | None:
    """Runs of consecutive rows ``(first, end, first key)`` of a one-query-per-row step under
    the boolean ``mask`` [B, 1, 1, T]: each run is attended over keys ``first key:`` only,
    which every row of the run masks before (so each row's product is the one under the
    whole mask, up to the rounding of another block split). None where one call over every
    key costs less (rows of similar lengths), or for a mask this does not read."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return None
    if mask.shape[-1] != t or mask.shape[0] < 2:
        return None
    seen = getattr(_RUNS, "last", None)
    version = None if mask.is_inference() else mask._version  # inference tensors keep none
    if seen is not None and seen[0] is mask and seen[1] == version:
        return seen[2]
    # Each row's first visible key (argmax: the first True; a row with none gives 0).
    starts = mask[:, 0, 0].to(torch.uint8).argmax(-1).tolist()
    runs = _cheapest_runs(starts, t)
    _RUNS.last = (mask, version, runs)
    return runs


def _cheapest_runs(starts: list[int], t: int) -> list[tuple[int, int, int]] | None:
    """The split of rows ``0..B-1`` (first keys ``starts``, ``t`` keys) into runs of
    consecutive rows of least cost: per run its rows times the keys from its earliest first
    key, plus :data:`RUN_CALL_COST` a call. None where one run (one call) is cheapest."""
    n = len(starts)
    best = [0.0] + [float("inf")] * n  # best[e]: rows 0..e-1 split into runs
    cut = [0] * (n + 1)
    for e in range(1, n + 1):
        s = t
        for a in range(e - 1, -1, -1):
            s = min(s, starts[a])
            cost = best[a] + (e - a) * (t - s) + RUN_CALL_COST
            if cost < best[e]:
                best[e], cut[e] = cost, a
    if best[n] >= n * (t - min(starts)) + RUN_CALL_COST - 1e-9:
        return None
    runs = []
    e = n
    while e > 0:
        a = cut[e]
        runs.append((a, e, min(starts[a:e])))
        e = a
    return runs[::-1]


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
        query[:, :, :r],
        key[:, :, :r],
        value[:, :, :r],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
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
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    dropout: float,
    kwargs: dict[str, Any],
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
) -> torch.Tensor:
    """Masked attention with the query heads grouped per key/value head (no repeated keys).

    ``query`` [B, H, q, hd], ``key``/``value`` [B, Hkv, T, hd], ``attention_mask`` None or
    [B, 1, q, T] (bool or additive). Returns [B, q, H, hd]."""
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
    return out.view(b, h, q, hd).transpose(1, 2).contiguous()


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
