"""A KV cache that grows in place: no copy of the cache per generated token.

transformers' ``DynamicLayer`` appends with ``torch.cat``, copying every layer's cache at
every token. :class:`GrowableLayer` keeps keys and values in a buffer with spare capacity and exposes
views of its first ``n`` positions: an update writes only the new positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

#: Spare positions allocated beyond what is needed, at least and as a share of the length.
MIN_SPARE = 128
SPARE_SHARE = 0.25


def row_runs(rows: Sequence[tuple[Any, int]]) -> list[tuple[Any, int, int]]:
    """``rows`` (``(source, row)`` pairs, in order) as runs of consecutive rows of one source,
    ``(source, start, end)``: each run is one slice to copy."""
    runs: list[tuple[Any, int, int]] = []
    for src, r in rows:
        if runs and runs[-1][0] is src and runs[-1][2] == r:
            runs[-1] = (src, runs[-1][1], r + 1)
        else:
            runs.append((src, r, r + 1))
    return runs


def _capacity(need: int) -> int:
    """Positions to allocate for ``need`` positions: the need plus its spare."""
    return need + max(MIN_SPARE, int(need * SPARE_SHARE))


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values are views of a buffer with spare capacity."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._n = 0

    def _hold(self, kbuf: torch.Tensor, vbuf: torch.Tensor, n: int) -> None:
        """Keep ``kbuf`` / ``vbuf`` as the buffers; their first ``n`` positions are the cache."""
        self._kbuf, self._vbuf, self._n = kbuf, vbuf, n
        self.keys = kbuf[..., :n, :]
        self.values = vbuf[..., :n, :]

    @staticmethod
    def _alloc(
        k: torch.Tensor, v: torch.Tensor, rows: int, need: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty key and value buffers of ``rows`` rows (the other dimensions of ``k`` /
        ``v``) with room for ``need`` positions and their spare."""
        cap = _capacity(need)
        return (
            k.new_empty((rows, *k.shape[1:-2], cap, k.shape[-1])),
            v.new_empty((rows, *v.shape[1:-2], cap, v.shape[-1])),
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, k = self._n, key_states.shape[-2]
        if (
            self._kbuf is None
            or n + k > self._kbuf.shape[-2]
            or self._kbuf.shape[:-2] != key_states.shape[:-2]
        ):
            kbuf, vbuf = self._alloc(key_states, value_states, key_states.shape[0], n + k)
            if n:
                kbuf[..., :n, :] = self.keys
                vbuf[..., :n, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[..., n : n + k, :] = key_states
        self._vbuf[..., n : n + k, :] = value_states
        self._n = n + k
        self.keys = self._kbuf[..., : self._n, :]
        self.values = self._vbuf[..., : self._n, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of positions, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._n = max(0, self._n - abs(tokens_to_remove))
        if self._kbuf is not None:
            self._hold(self._kbuf, self._vbuf, self._n)  # type: ignore[arg-type]

    def set_left_padded(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Hold the rows of several caches, each left-padded with zeros to the longest, in
        one buffer (one copy of each; whatever the layer held is replaced)."""
        self.lazy_initialization(keys[0], values[0])
        n = max(k.shape[-2] for k in keys)
        kbuf, vbuf = self._alloc(keys[0], values[0], sum(k.shape[0] for k in keys), n)
        r = 0
        for k, v in zip(keys, values, strict=True):
            b, extra = k.shape[0], n - k.shape[-2]
            if extra:
                kbuf[r : r + b, ..., :extra, :] = 0
                vbuf[r : r + b, ..., :extra, :] = 0
            kbuf[r : r + b, ..., extra:n, :] = k
            vbuf[r : r + b, ..., extra:n, :] = v
            r += b
        self._hold(kbuf, vbuf, n)

    def keep_rows(self, rows: torch.Tensor, start: int = 0) -> None:
        """Keep only batch rows ``rows`` (in that order), from position ``start`` on (the
        positions before it must be padding in every kept row): what is kept is copied once,
        run by run of consecutive rows, into a new buffer with spare capacity."""
        if self.get_seq_length() == 0:
            return
        keys, values = self.keys, self.values
        n = self._n - start
        kbuf, vbuf = self._alloc(keys, values, len(rows), n)
        i = 0
        for _, a, e in row_runs([(None, int(r)) for r in rows]):
            j = i + e - a
            kbuf[i:j, ..., :n, :] = keys[a:e, ..., start:, :]
            vbuf[i:j, ..., :n, :] = values[a:e, ..., start:, :]
            i = j
        self._hold(kbuf, vbuf, n)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.set_left_padded(
                [self.keys.repeat_interleave(repeats, dim=0)],
                [self.values.repeat_interleave(repeats, dim=0)],
            )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.set_left_padded([self.keys[indices, ...]], [self.values[indices, ...]])

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._n = 0
        super().reset()


def new_cache(model: Any) -> Any:
    """A ``DynamicCache`` for ``model`` whose layers grow in place and keep every position.

    Sliding-window layers get a full layer too (transformers' keeps only the last
    ``window - 1`` positions, so an attention row recomputed after a step would lack the
    oldest key it attended to); the window is still applied by the mask transformers builds
    from the config. Other layer kinds (quantised, offloaded...) are kept as built."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    cache.layers = [
        GrowableLayer() if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    return cache


def has_sliding_window(model: Any) -> bool:
    """Whether some attention layer of ``model`` attends over a sliding window (a custom 4D
    mask would bypass it: the packed prefill does not apply)."""
    cfg = getattr(model, "config", None)
    types_ = getattr(cfg, "layer_types", None) or []
    if any("sliding" in str(t) for t in types_):
        return True
    from ..attention.parts import attention_window, model_parts

    try:
        attn = model_parts(model).attn
    except ValueError:
        return bool(getattr(cfg, "sliding_window", None))
    return any(attention_window(a) for a in attn)


def is_full_layer(layer: Any) -> bool:
    """Whether a cache layer keeps every position (so it can be rolled back)."""
    return type(layer) in (DynamicLayer, GrowableLayer)
