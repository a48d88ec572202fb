"""The probe: a forward pass leaves each layer's last-position states in a tap (the wrapped
decoder layers write them), collected as a :class:`ProbeRecord`."""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from .parts import ModelParts, model_parts


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
