"""The role batch: all contexts of one role across a batch of queries, with their KV cache.

Padding, position ids, probed model calls, prefill from another role's prompt head and fork
(an independent copy). The loops in :mod:`.loop` and the speed paths in
:mod:`..accel` drive it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from ..attention.parts import ModelParts, model_parts
from ..attention.probe import Probe, ProbeRecord
from ..models import LoadedModel, cache_argument, model_cache
from ..policies.base import ContextSpec
from .kv_cache import is_full_layer, new_cache

#: Shortest shared prompt head worth reusing from another context's prefill.
MIN_SHARED_PREFIX = 8


class RoleBatch:
    """All contexts of one role across the batch of queries, with their KV cache."""

    def __init__(
        self, role: str, members: list[tuple[int, ContextSpec]], lm: LoadedModel, probe: bool
    ):
        self.role = role
        self.query_idx = [q for q, _ in members]
        self.specs = [s for _, s in members]
        self.lm = lm
        self.probe = probe
        self.parts: ModelParts | None = model_parts(lm.model) if probe else None
        dev = lm.model.device
        n = max(len(s.ids) for s in self.specs)
        self.pad = [n - len(s.ids) for s in self.specs]
        ids = torch.full((len(self.specs), n), lm.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(self.specs), n), dtype=torch.long)
        for r, s in enumerate(self.specs):
            ids[r, self.pad[r] :] = torch.tensor(s.ids, dtype=torch.long)
            mask[r, self.pad[r] :] = 1
        self.ids = ids.to(dev)
        self.mask = mask.to(dev)
        self.cache = new_cache(lm.model)
        self.logits: torch.Tensor = torch.empty(0)
        self.records: ProbeRecord | None = None

    def keeps_every_position(self) -> bool:
        """Whether every layer of the KV cache keeps every position (full attention)."""
        return all(is_full_layer(layer) for layer in self.cache.layers)

    def cache_row(self, row: int) -> int:
        """The KV-cache row holding ``row``'s keys (one per row here; a packed batch keeps
        all its contexts in one)."""
        return row

    def fork(self, probe: bool) -> RoleBatch:
        """A copy that can advance independently (own KV cache; other tensors are rebound,
        never written in place). ``probe=False`` drops the probes of a probed prefill."""
        twin = object.__new__(RoleBatch)
        twin.__dict__.update(self.__dict__)
        twin.cache = copy.deepcopy(self.cache)
        if not probe:
            twin.probe, twin.parts, twin.records = False, None, None
        return twin

    def forward(self, new_ids: torch.Tensor | None) -> None:
        """Prefill (``new_ids`` None) or advance every row by one token ([B] long)."""
        if new_ids is None:
            inp = self.ids
            pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        else:
            inp = new_ids.view(-1, 1).to(self.ids.device)
            pos = self.mask.sum(-1, keepdim=True)
            self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        self._call(inp, pos)

    def shared_prefix(self, src: RoleBatch) -> int:
        """Length of the prompt head every row shares with its query's row in ``src`` (0
        when it cannot be reused: rows of unequal length, a query missing from ``src``, a
        cache kind other than full attention, or fewer than ``MIN_SHARED_PREFIX`` tokens)."""
        if any(self.pad) or src.lm is not self.lm or not src.cache.layers:
            return 0
        if any(not is_full_layer(layer) or not layer.is_initialized for layer in src.cache.layers):
            return 0
        rows = {q: r for r, q in enumerate(src.query_idx)}
        if any(q not in rows for q in self.query_idx):
            return 0
        h = None
        for q, spec in zip(self.query_idx, self.specs, strict=True):
            other = src.specs[rows[q]].ids
            n = 0
            for a, b in zip(spec.ids, other, strict=False):
                if a != b:
                    break
                n += 1
            h = n if h is None else min(h, n)
        # At least one token of this prompt must still be run (its logits start decoding).
        h = min(h or 0, len(self.specs[0].ids) - 1)
        return h if h >= MIN_SHARED_PREFIX else 0

    def prefill_from(self, src: RoleBatch, h: int) -> None:
        """Prefill with the first ``h`` positions' keys and values copied from ``src`` (whose
        rows' prompts start with the same ``h`` tokens), running only the remaining tokens.
        The same numbers as :meth:`forward` up to the rounding of a different batch shape."""
        rows = {q: r for r, q in enumerate(src.query_idx)}
        src_rows = [rows[q] for q in self.query_idx]
        cache = new_cache(self.lm.model)
        for layer, sl in zip(cache.layers, src.cache.layers, strict=True):
            # Every row's head has the same length: rows side by side, no padding.
            layer.set_left_padded(
                [sl.keys[r : r + 1, :, src.pad[r] : src.pad[r] + h] for r in src_rows],
                [sl.values[r : r + 1, :, src.pad[r] : src.pad[r] + h] for r in src_rows],
            )
        self.cache = cache
        n = self.ids.shape[1]
        pos = torch.arange(h, n, device=self.ids.device).expand(self.ids.shape[0], -1)
        self._call(self.ids[:, h:], pos)

    def _call(self, inp: torch.Tensor, pos: torch.Tensor) -> None:
        """One forward pass over ``inp`` with the cache; the last position's logits go to
        ``self.logits``."""
        kwargs = dict(input_ids=inp, attention_mask=self.mask, position_ids=pos, logits_to_keep=1)
        self.logits = self._model_pass(kwargs, probe=self.probe)[:, -1, :]

    def _model_pass(
        self, kwargs: dict[str, Any], *, probe: bool, positions: list[int] | None = None
    ) -> torch.Tensor:
        """The model over ``kwargs`` with this batch's cache (updated in place); under a probe
        (the states of sequence ``positions``, default the last) its records go to
        ``self.records``. Returns the kept logits as float."""
        model = self.lm.model
        kwargs = {**kwargs, cache_argument(model): self.cache, "use_cache": True}
        if probe:
            with Probe(model, positions=positions) as p:
                out = model(**kwargs)
            self.records = p.take()
        else:
            out = model(**kwargs)
            self.records = None
        self.cache = model_cache(out)
        return out.logits.float()

    def can_keep_rows(self) -> bool:
        """Whether :meth:`keep_rows` applies: one row per context, a cache whose every
        layer can drop rows (full attention, growing in place)."""
        return type(self).cache_row is RoleBatch.cache_row and all(
            hasattr(layer, "keep_rows") and is_full_layer(layer) for layer in self.cache.layers
        )

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row but ``rows`` (in that order), e.g. those of queries that finished,
        so that later steps do not compute them; the key positions that are padding in
        every kept row are dropped too. Each kept row computes what it computed before, up
        to the rounding of a different batch shape."""
        if not self.can_keep_rows():
            raise RuntimeError("this batch cannot drop rows")
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.ids.device)
        mask = self.mask.index_select(0, idx)
        valid = mask.bool().any(0)
        start = int(valid.int().argmax()) if bool(valid.any()) else 0
        for layer in self.cache.layers:
            layer.keep_rows(idx, start)
        self.mask = mask[:, start:]
        self.ids = self.ids.index_select(0, idx)[:, start:]  # start < prompt length
        self.query_idx = [self.query_idx[r] for r in rows]
        self.specs = [self.specs[r] for r in rows]
        self.pad = [self.pad[r] - start for r in rows]
        self.logits = self.logits.index_select(0, idx)
        if self.records is not None:
            self.records = self.records.select(idx)
