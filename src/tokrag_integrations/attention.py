"""Reading a model's layers without eager attention.

Tok-RAG needs, at a disagreement step, the residual stream of the last position after every
layer (for the logit lens, Eq. 13) and the attention row of the last position of the RAG
context at every layer (f(l) and Att, Eq. 14–15). Running the whole model with eager
attention to get those rows would slow every prefill by about 50 %, so instead:

* the decoder layers' forwards (wrapped once per model: a plain function call, not module
  hooks, so an unprobed pass pays one context-variable read per layer) leave the last
  position's residual state and rotary embedding of every layer in the active probe's tap
  during the ordinary (SDPA) forward pass (a few KB per step); the attention input is
  derived from the residual on demand (the layer's input norm);
* on CPU, the attention function (:func:`.accel.cpu_kernels.few_query_attention`) also leaves
  each probed row's rotated query in the tap, so at a disagreement step an attention row is
  one ``q·K`` per layer with the keys already in the KV cache
  (:func:`attention_from_queries`);
* elsewhere, the attention row is recomputed from that attention input and the cached keys:
  one query projection and one ``q·K`` per layer.

The recomputation follows the model's own attention module (q_norm where the model has it,
its rotary function, its scaling, soft-capping and sliding window) and is tested against
``output_attentions=True`` of an eager model to 1e-4.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Callable
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
            "with load_model(..., require_signals=False) for the 'rag'/'llm' policies, which "
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


class ProbeRecord:
    """Last-position states of one forward pass.

    Shapes (B = batch rows, L = layers, d = hidden size, H = heads, hd = head dim):
    ``resid`` [L+1, B, d] (h^0 = embeddings, h^l = output of layer l, before the final
    norm); ``attn_in`` [L, B, d] (the normed input of each attention module; derived from
    ``resid`` on first access when the probe did not store it); ``cos``/``sin`` lists of
    [B, hd] (each layer's rotary embedding of the last position); ``query`` (optional) per
    layer the rotated query of the last position, [B, H, hd], as the forward pass computed
    it, with ``query_scale`` its attention scaling: an attention row is then one ``q·K`` away
    (no projection to redo).
    """

    def __init__(
        self,
        resid: torch.Tensor,
        attn_in: torch.Tensor | None,
        cos: list[torch.Tensor],
        sin: list[torch.Tensor],
        *,
        norms: list[Any] | None = None,
        query: list[torch.Tensor] | None = None,
        query_scale: list[float] | None = None,
    ):
        if attn_in is None and norms is None:
            raise ValueError("ProbeRecord needs attn_in or the layers' input norms to derive it")
        if (query is None) != (query_scale is None):
            raise ValueError("ProbeRecord takes query and query_scale together")
        self.resid = resid
        self._attn_in = attn_in
        self.cos = cos
        self.sin = sin
        self.norms = norms
        self.query = query
        self.query_scale = query_scale

    @property
    def attn_in(self) -> torch.Tensor:
        if self._attn_in is None:
            assert self.norms is not None
            # Each attention module's input is its layer's input norm of the layer's input.
            self._attn_in = torch.stack([norm(self.resid[i]) for i, norm in enumerate(self.norms)])
        return self._attn_in

    def select(self, rows: torch.Tensor | list[int]) -> ProbeRecord:
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.resid.device)
        return ProbeRecord(
            resid=self.resid.index_select(1, idx),
            attn_in=None if self._attn_in is None else self._attn_in.index_select(1, idx),
            cos=[c.index_select(0, idx) for c in self.cos],
            sin=[s.index_select(0, idx) for s in self.sin],
            norms=self.norms,
            query=None if self.query is None else [q.index_select(0, idx) for q in self.query],
            query_scale=self.query_scale,
        )

    @staticmethod
    def cat(records: list[ProbeRecord]) -> ProbeRecord:
        """The rows of several records, in order (one record per fused role batch)."""
        lazy = any(r._attn_in is None for r in records)
        keep_q = all(r.query is not None for r in records) and all(
            r.query_scale == records[0].query_scale for r in records
        )
        return ProbeRecord(
            resid=torch.cat([r.resid for r in records], dim=1),
            attn_in=None if lazy else torch.cat([r.attn_in for r in records], dim=1),
            cos=[torch.cat(c) for c in zip(*(r.cos for r in records), strict=True)],
            sin=[torch.cat(c) for c in zip(*(r.sin for r in records), strict=True)],
            norms=records[0].norms,
            query=(
                [torch.cat(q) for q in zip(*(r.query for r in records), strict=True)]  # type: ignore[arg-type]
                if keep_q
                else None
            ),
            query_scale=records[0].query_scale if keep_q else None,
        )


class _Tap:
    """Where the forward pass of an active :class:`Probe` leaves its last-position states."""

    __slots__ = ("resid", "cos", "sin", "query", "scale", "pe", "positions")

    def __init__(self, n_layers: int, positions: list[int] | None = None):
        # Sequence positions to keep (each becomes a record row; batch 1 only), None = the
        # last position of every batch row. Consecutive positions index as a slice (views).
        self.positions: slice | torch.Tensor | None = None
        if positions is not None:
            p0 = positions[0] if positions else 0
            if positions == list(range(p0, p0 + len(positions))):
                self.positions = slice(p0, p0 + len(positions))
            else:
                self.positions = torch.tensor(positions, dtype=torch.long)
        self.pe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.resid: list[torch.Tensor | None] = [None] * (n_layers + 1)
        self.cos: list[torch.Tensor | None] = [None] * n_layers
        self.sin: list[torch.Tensor | None] = [None] * n_layers
        # Per layer: the rotated query of each record row [rows, H, hd] and its scaling, left
        # by an attention function that knows them (:mod:`.accel.cpu_kernels`).
        self.query: list[torch.Tensor | None] = [None] * n_layers
        self.scale: list[float | None] = [None] * n_layers


#: The taps of the probes active in this thread / task, innermost last (empty: nothing is kept).
ACTIVE_TAP: contextvars.ContextVar[tuple[_Tap, ...]] = contextvars.ContextVar("tokrag_tap", default=())


def _last(t: torch.Tensor, positions: slice | torch.Tensor | None = None) -> torch.Tensor:
    # A decode step's tensors are [B, 1, ...]: a view keeps nothing large alive. A prefill's
    # are [B, T, ...]: copy the last position so the rest can be freed. With ``positions``
    # (a packed batch-1 sequence holding several contexts) those positions become the rows.
    if positions is not None:
        out = t[0, positions].detach()  # a view for a slice, a copy for an index
        return out.clone() if isinstance(positions, slice) and t.shape[1] > out.shape[0] else out
    return t[:, -1].detach() if t.shape[1] == 1 else t[:, -1].detach().clone()


def _tapped_forward(layer: Any, i: int) -> Any:
    """``layer.forward`` that also leaves its input, output and rotary embedding in the active
    tap. A plain function call instead of module hooks: with no probe active it costs one
    context-variable read."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        for tap in ACTIVE_TAP.get():
            at = tap.positions
            if i == 0:
                tap.resid[0] = _last(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0], at)
            h = out[0] if isinstance(out, (tuple, list)) else out
            tap.resid[i + 1] = _last(h, at)
            pe = kwargs.get("position_embeddings")
            if pe is not None:
                # Layers that share one rotary embedding (most models) share one slice.
                if tap.pe is None or tap.pe[0] is not pe[0]:
                    tap.pe = (pe[0], _last(pe[0], at), _last(pe[1], at))
                tap.cos[i], tap.sin[i] = tap.pe[1], tap.pe[2]
        return out

    return forward


def install_taps(parts: ModelParts) -> bool:
    """Wrap every decoder layer's forward once (idempotent); False where the layers lack an
    input norm to derive the attention input from (the probe then uses hooks)."""
    if all(getattr(layer, "_tokrag_tapped", False) for layer in parts.layers):
        return True
    if not all(hasattr(layer, "input_layernorm") for layer in parts.layers):
        return False
    for i, layer in enumerate(parts.layers):
        if not getattr(layer, "_tokrag_tapped", False):
            layer.forward = _tapped_forward(layer, i)
            layer._tokrag_tapped = True
    return True


class Probe:
    """Context manager that records last-position states during a forward pass.

    The decoder layers' forwards leave their states in a context-local tap (installed once
    per model, free when no probe is active); the attention function of
    :mod:`.accel.cpu_kernels` adds the rotated queries. Models whose layers
    cannot be tapped that way are probed with module hooks.

    ``positions`` (a batch of one sequence packing several contexts) records those sequence
    positions instead of each row's last one: record row ``i`` is position ``positions[i]``.
    """

    def __init__(self, model: Any, positions: list[int] | None = None):
        self.parts = model_parts(model)
        self.positions = list(positions) if positions is not None else None
        self._handles: list[Any] = []
        self._tap: _Tap | None = None
        self._token: Any = None
        self._attn_in: list[torch.Tensor | None] = []
        self._hooked = False  # kept after __exit__, which removes the hooks

    def __enter__(self) -> Probe:
        n = self.parts.num_layers
        self._tap = _Tap(n, self.positions)
        if not install_taps(self.parts):
            if self.positions is not None:
                raise ValueError(
                    f"{type(self.parts.layers[0]).__name__}: probing chosen positions needs "
                    "decoder layers with an input_layernorm"
                )
            self._hook(self._tap)
        self._token = ACTIVE_TAP.set((*ACTIVE_TAP.get(), self._tap))
        return self

    def _hook(self, tap: _Tap) -> None:
        n = self.parts.num_layers
        self._attn_in = [None] * n
        self._hooked = True

        def embed_hook(_m: Any, _inp: Any, out: Any) -> None:
            tap.resid[0] = _last(out)

        self._handles.append(self.parts.embed.register_forward_hook(embed_hook))
        for i, (layer, attn) in enumerate(zip(self.parts.layers, self.parts.attn, strict=True)):

            def layer_hook(_m: Any, _inp: Any, out: Any, i: int = i) -> None:
                h = out[0] if isinstance(out, (tuple, list)) else out
                tap.resid[i + 1] = _last(h)

            def attn_pre_hook(_m: Any, args: Any, kwargs: Any, i: int = i) -> None:
                hs = kwargs.get("hidden_states", args[0] if args else None)
                self._attn_in[i] = _last(hs)
                pe = kwargs.get("position_embeddings")
                if pe is None and len(args) > 1:
                    pe = args[1]
                cos, sin = pe
                tap.cos[i] = _last(cos)
                tap.sin[i] = _last(sin)

            self._handles.append(layer.register_forward_hook(layer_hook))
            self._handles.append(attn.register_forward_pre_hook(attn_pre_hook, with_kwargs=True))

    def take(self) -> ProbeRecord:
        """Return the states of the most recent forward pass."""
        tap = self._tap
        if tap is None or any(r is None for r in tap.resid):
            raise RuntimeError("Probe.take() called before a forward pass")
        if any(c is None for c in tap.cos):
            raise RuntimeError(
                f"{type(self.parts.layers[0]).__name__} did not receive position_embeddings as "
                "a keyword argument: the probe cannot read its rotary embedding"
            )
        hooked = self._hooked
        if hooked and any(a is None for a in self._attn_in):
            raise RuntimeError("Probe.take() called before a forward pass")
        kept = all(q is not None for q in tap.query)
        return ProbeRecord(
            resid=torch.stack(tap.resid),  # type: ignore[arg-type]
            attn_in=torch.stack(self._attn_in) if hooked else None,  # type: ignore[arg-type]
            cos=list(tap.cos),  # type: ignore[arg-type]
            sin=list(tap.sin),  # type: ignore[arg-type]
            norms=None if hooked else [layer.input_layernorm for layer in self.parts.layers],
            query=list(tap.query) if kept else None,  # type: ignore[arg-type]
            query_scale=list(tap.scale) if kept else None,  # type: ignore[arg-type]
        )

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            ACTIVE_TAP.reset(self._token)
            self._token = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def cached_keys(cache: Any, layer_idx: int) -> torch.Tensor:
    """Keys of one layer from a transformers cache: [B, kv_heads, T_kept, hd]."""
    if hasattr(cache, "layers"):
        return cache.layers[layer_idx].keys
    return cache.key_cache[layer_idx]  # pragma: no cover - transformers < 4.56


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
    scores = torch.empty(n_layers, n_kv, groups, seen_len - start)
    for i in range(n_layers):
        qg = queries[i].reshape(n_kv, groups, head_dim).float()
        torch.matmul(qg, keys[i][0, :, start:seen_len].float().transpose(-1, -2), out=scores[i])
    scores = scores.view(n_layers, n_heads, seen_len - start)
    if len(set(scales)) == 1:
        scores.mul_(scales[0])
    else:
        scores.mul_(torch.tensor(scales, dtype=scores.dtype)[:, None, None])
    scores = scores.masked_fill_(~valid[None, None, start:], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.nn.functional.pad(probs, (start, 0)) if start else probs


#: A faster many-row product with an LM head, registered by a speed path
#: (:mod:`.accel.cpu_kernels` registers :func:`.accel.cpu_kernels.packed_head` when it is imported):
#: ``head -> product`` or None where the head's own forward is to be used.
_lens_head_product: Callable[[Any], Callable[[torch.Tensor], torch.Tensor] | None] | None = None


def set_lens_head_product(
    fn: Callable[[Any], Callable[[torch.Tensor], torch.Tensor] | None] | None,
) -> None:
    """Let :func:`logit_lens` multiply many rows by the LM head through ``fn(head)`` (None:
    the head's own forward). The seam keeps this module free of imports of the speed paths:
    they register themselves here instead."""
    global _lens_head_product
    _lens_head_product = fn


def logit_lens(parts: ModelParts, resid: torch.Tensor, *, final_norm: bool = True) -> torch.Tensor:
    """phi(h): logits read off any layer's residual state.

    ``final_norm=True`` applies the model's final norm before the LM head (the usual logit
    lens); ``False`` applies the LM head directly, as the authors' released code does.
    Input [..., d] -> output [..., V] (float32). Many rows at once go through the product
    registered with :func:`set_lens_head_product` (:func:`.accel.cpu_kernels.packed_head`) where
    it gives one.
    """
    h = resid.to(parts.lm_head.weight.dtype)
    if final_norm:
        h = parts.final_norm(h)
    logits = None
    if h.dim() == 2 and h.shape[0] > 1 and _lens_head_product is not None:
        product = _lens_head_product(parts.lm_head)
        if product is not None:  # falls back to the routed product below a few rows
            logits = product(h).float()
    if logits is None:
        logits = parts.lm_head(h).float()
    if parts.logits_scaling:  # as the model's own head (Granite)
        logits = logits / parts.logits_scaling
    cap = parts.final_logit_softcap
    if cap:  # as the model's own head (Gemma 2): the lens of the last layer is its logits
        logits = torch.tanh(logits / cap) * cap
    return logits
