"""What a policy sees at one step: :class:`ContextView`, one row of a role batch
(:mod:`.batch`), the protocol :class:`..policies.base.View` (next-token logits and
probabilities, the retrieved-token positions and ids, per-layer states and attention rows
recomputed on demand from the batch's KV cache); and :func:`make_lens`, the
:data:`..policies.base.Lens` the engine hands the policy."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention.parts import model_parts
from ..attention.probe import ProbeRecord
from ..attention.rows import (
    attention_from_queries,
    attention_row,
    attention_rows,
    cached_keys,
    logit_lens,
)
from ..contexts.batch import RoleBatch
from ..models import LoadedModel
from ..policies.base import ContextSpec, Lens

__all__ = ["ContextView", "make_lens"]


def make_lens(
    lm: LoadedModel,
    share: bool = True,
    product: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Lens:
    """The logit lens of ``lm`` as a :data:`..policies.base.Lens`: with ``share`` (the
    ``share_lens`` of :class:`..speed.Speed`) every block of one call in one product (the LM
    head read once), else one product per block; ``product``: the decode's way to multiply
    many rows by the LM head (:func:`..attention.rows.logit_lens`; the seam's packed head)."""

    def lens(blocks: list[torch.Tensor], final_norm: bool = True) -> list[torch.Tensor]:
        parts = model_parts(lm.model)
        if share and len(blocks) > 1:
            out = logit_lens(parts, torch.cat(blocks), final_norm=final_norm, product=product)
            return list(torch.log_softmax(out, dim=-1).split([b.shape[0] for b in blocks]))
        return [
            torch.log_softmax(
                logit_lens(parts, b, final_norm=final_norm, product=product), dim=-1
            )
            for b in blocks
        ]

    return lens


class ContextView:
    """What a policy sees of one context at one step (one row of a role batch). ``record``
    may be a zero-argument callable: it is then built on first access (most steps never
    read it)."""

    def __init__(
        self, batch: RoleBatch, row: int, record: ProbeRecord | Callable[[], ProbeRecord] | None
    ):
        self._batch = batch
        self._row = row
        self._record = record
        self.logits: torch.Tensor = batch.logits[row]
        self.spec: ContextSpec = batch.specs[row]
        self._seen = batch.mask.shape[1]
        self._probs: torch.Tensor | None = None
        self._attn: dict[int, torch.Tensor] = {}
        self._attn_all: torch.Tensor | None = None

    @property
    def record(self) -> ProbeRecord | None:
        if callable(self._record):
            self._record = self._record()
        return self._record

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = torch.softmax(self.logits.float(), dim=-1)
        return self._probs

    @property
    def rt_positions(self) -> torch.Tensor:
        """Positions of retrieved tokens in cache coordinates (left padding included)."""
        pad = self._batch.pad[self._row]
        return torch.tensor(
            [pad + p for p in self.spec.rt_positions], dtype=torch.long, device=self.logits.device
        )

    @property
    def rt_token_ids(self) -> torch.Tensor:
        ids = self.spec.ids
        return torch.tensor(
            [ids[p] for p in self.spec.rt_positions], dtype=torch.long, device=self.logits.device
        )

    def _probe(
        self, layers: range | list[int]
    ) -> tuple[ProbeRecord, list[torch.Tensor], torch.Tensor]:
        """The record, the cached keys [1, kv_heads, T, hd] of ``layers`` and the valid keys
        [1, seen] of this row."""
        rec = self.record
        if rec is None:
            raise RuntimeError("this policy did not ask for probe records of this context")
        b, r = self._batch, self._row
        keys = [cached_keys(b.cache, i)[b.cache_row(r)][None] for i in layers]
        return rec, keys, b.mask[r : r + 1, : self._seen].bool()

    def attention(self, layer_idx: int) -> torch.Tensor:
        """[H, T] attention of the last position at 0-based layer ``layer_idx`` (recomputed)."""
        if layer_idx not in self._attn:
            if not self._from_queries([layer_idx]):
                rec, (keys,), valid = self._probe([layer_idx])
                keys = keys[:, :, : self._seen]  # a cache may hold room for later positions
                got = attention_row(self._batch.parts, layer_idx, rec, keys, valid, self._seen)
                self._attn[layer_idx] = got[0]
        return self._attn[layer_idx]

    def _from_queries(self, layers: list[int]) -> bool:
        """Where the forward pass left the rotated queries and the cache holds exactly the
        seen keys: the attention at ``layers`` from them, in one :func:`attention_from_queries`
        call (one ``q·K`` a layer, the same products as layer by layer), read from the batch's
        record without building this row's; False (nothing done) otherwise."""
        recs, b, r, seen = self._batch.records, self._batch, self._row, self._seen
        if recs is None or recs.query is None:
            return False
        keys = [cached_keys(b.cache, i)[b.cache_row(r)][None, :, :seen] for i in layers]
        if any(k.shape[2] != seen for k in keys):
            return False
        queries = [recs.query[i][r] for i in layers]  # type: ignore[index]
        scales = [recs.query_scale[i] for i in layers]  # type: ignore[index]
        valid = b.mask[r : r + 1, :seen].bool()
        out = attention_from_queries(queries, scales, keys, valid, seen)
        for i, row in zip(layers, out, strict=True):
            self._attn[i] = row
        return True

    def attention_rows(self, layers: list[int]) -> torch.Tensor:
        """[n, H, T] attention of the last position at ``layers`` (0-based): the rows a rule
        already read at this step are reused, the others recomputed (in one go where that
        is most of the layers, or from the recorded queries)."""
        missing = [i for i in layers if i not in self._attn]
        if len(missing) > 1 and len(missing) * 2 > len(self._batch.cache.layers):
            self.attention_all()
        elif len(missing) > 1:
            self._from_queries(missing)
        return torch.stack([self.attention(i) for i in layers])

    def attention_all(self) -> torch.Tensor:
        """[L, H, T] attention of the last position at every layer (recomputed in one go)."""
        if self._attn_all is not None:
            return self._attn_all
        b, n = self._batch, len(self._batch.cache.layers)
        if not b.keeps_every_position():
            return torch.stack([self.attention(i) for i in range(n)])
        rec, keys, valid = self._probe(range(n))
        if rec.query is not None:  # the forward pass left the rotated queries: one q·K a layer
            queries = [q[0] for q in rec.query]
            out = attention_from_queries(queries, rec.query_scale, keys, valid, self._seen)  # type: ignore[arg-type]
        else:
            out = attention_rows(b.parts, rec, keys, valid, self._seen)
        for i in range(n):
            self._attn.setdefault(i, out[i])
        self._attn_all = out
        return out
