"""Fused and packed contexts: all contexts of a decode in one forward pass per step.

:func:`prefill` is the prefill of :class:`..engine.decoder.Decoder`: one query's two
contexts packed into one sequence (:func:`prefill_packed`), or every role's batch merged
into one left-padded batch (:func:`fuse_batches`), or the plain per-role prefill where
neither applies. Each computes what the per-role batches compute,
up to the rounding of a different kernel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..attention.parts import model_parts
from ..attention.probe import ProbeRecord, install_taps
from ..contexts.batch import RoleBatch
from ..contexts.kv_cache import (
    GrowableLayer,
    has_sliding_window,
    is_full_layer,
    new_cache,
    row_runs,
)
from ..contexts.prefill import _SHARED_PREFILL, Prefilled, prefill_roles, reused_seconds, row_map
from ..models import LoadedModel
from ..policies.base import ContextSpec
from ..speed import Speed
from .install import fusion_off_reason
from .sdpa import ATTN_IMPLEMENTATION, PACKED_PREFILL


def fuse_batches(batches: Sequence[RoleBatch]) -> RoleBatch | None:
    """One batch holding the rows of several prefilled role batches, so that a decode step
    is one forward pass instead of one per role.

    Each batch is left-padded to the longest (padding positions are masked, hold zero keys
    and take no position id), so every row computes what it computed alone, up to the
    rounding of a different kernel. Returns None where rows cannot share a batch: caches
    that are not full-attention (sliding windows), or roles probed differently.
    """
    if len(batches) < 2:
        return None
    fused = fuse_rows([(b, r) for b in batches for r in range(len(b.query_idx))])
    if fused is not None:
        fused.role = "+".join(b.role for b in batches)
    return fused


def fuse_rows(rows: Sequence[tuple[RoleBatch, int]]) -> RoleBatch | None:
    """One batch holding the given rows of prefilled batches, in that order (each ``(batch,
    row)``), left-padded to the longest as in :func:`fuse_batches`; each row's keys and
    values are copied once. None where they cannot share a batch (see there)."""
    batches = list({id(b): b for b, _ in rows}.values())
    if not rows or len({b.probe for b in batches}) != 1:
        return None
    if any(not is_full_layer(layer) for b in batches for layer in b.cache.layers):
        return None
    if any(b.probe and b.records is None for b in batches):
        return None
    first = batches[0]
    n = max(b.mask.shape[1] for b in batches)
    fused = object.__new__(RoleBatch)
    fused.__dict__.update(first.__dict__)
    fused.role = "+".join(dict.fromkeys(b.role for b in batches))
    fused.query_idx = [b.query_idx[r] for b, r in rows]
    fused.specs = [b.specs[r] for b, r in rows]
    fused.pad = [b.pad[r] + n - b.mask.shape[1] for b, r in rows]

    def left(x: torch.Tensor, extra: int, value: float, dim: int) -> torch.Tensor:
        if not extra:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x.new_full(shape, value), x], dim=dim)

    runs = row_runs(rows)  # consecutive rows of one batch: one slice each
    fused.ids = torch.cat(
        [left(b.ids[a:e], n - b.mask.shape[1], first.lm.pad_token_id, 1) for b, a, e in runs]
    )
    fused.mask = torch.cat([left(b.mask[a:e], n - b.mask.shape[1], 0, 1) for b, a, e in runs])
    fused.logits = torch.cat([b.logits[a:e] for b, a, e in runs])
    cache = new_cache(first.lm.model)
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, GrowableLayer):  # pragma: no cover - guarded above
            return None
        # Each batch's cache covers its mask (a fresh prefill: the mask's length).
        layer.set_left_padded(
            [b.cache.layers[i].keys[a:e] for b, a, e in runs],
            [b.cache.layers[i].values[a:e] for b, a, e in runs],
        )
    fused.cache = cache
    if first.probe:
        fused.records = ProbeRecord.cat(
            [b.records.select(list(range(a, e))) for b, a, e in runs]  # type: ignore[union-attr]
        )
    return fused


class _PackedBatch(RoleBatch):
    """One query's two contexts in one sequence of one KV cache.

    The sequence is the longer prompt, then the shorter prompt's part after the head both
    share, then per step one token for each context (in row order). ``mask`` [2, T] says
    which positions each context sees (its own prompt, the shared head, its own tokens), so
    :class:`ContextView` reads a row as of any batch; every row lives in cache row 0. A step
    is one forward pass of two query positions under that mask: the keys are read once for
    both contexts (a fused two-row batch reads each row's own keys in a call of its own).
    """

    def cache_row(self, row: int) -> int:
        return 0

    def forward(self, new_ids: torch.Tensor | None) -> None:
        """Advance both contexts by one token (``new_ids`` [2] long, in row order)."""
        if new_ids is None:
            raise RuntimeError("a packed batch is prefilled by prefill_packed")
        dev = self.ids.device
        t = self.mask.shape[1]
        self.mask = torch.cat([self.mask, torch.eye(2, dtype=self.mask.dtype, device=dev)], dim=1)
        pos = self._next[None].clone()
        self._next = self._next + 1
        visible = self.mask[:, : t + 2].bool()
        # Additive: 0 where a context sees a key, -inf elsewhere (the CPU flash path).
        mask = torch.zeros(visible.shape, dtype=self.lm.model.dtype, device=dev)
        mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
        self.logits = self._run(new_ids.view(1, 2).to(dev), pos, mask, keep=2, positions=[0, 1])[0]

    def _run(
        self,
        inp: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        *,
        keep: int | torch.Tensor,
        positions: list[int],
    ) -> torch.Tensor:
        return self._model_pass(
            dict(input_ids=inp, attention_mask=mask, position_ids=pos, logits_to_keep=keep),
            probe=self.probe,
            positions=positions,
        )

    def unpacked(self) -> RoleBatch:
        """The same two contexts as a plain two-row batch (so that other rows can join it):
        each row's keys and values are the positions its mask shows, in order, left-padded
        to the longer row. The keys were rotated with each context's own position ids, which
        a row's mask count continues, so every row computes what it computed packed, up to
        the rounding of another attention path."""
        visible = [self.mask[r].bool() for r in range(2)]
        lengths = [int(v.sum()) for v in visible]
        n = max(lengths)
        plain = object.__new__(RoleBatch)
        plain.__dict__.update({k: v for k, v in self.__dict__.items() if k != "_next"})
        plain.pad = [n - m for m in lengths]
        dev = self.ids.device
        plain.mask = torch.zeros((2, n), dtype=self.mask.dtype, device=dev)
        for r, m in enumerate(lengths):
            plain.mask[r, n - m :] = 1
        plain.ids = torch.full((2, n), self.lm.pad_token_id, dtype=torch.long, device=dev)
        cache = new_cache(self.lm.model)
        for layer, packed in zip(cache.layers, self.cache.layers, strict=True):
            layer.set_left_padded(
                [packed.keys[:, :, v] for v in visible], [packed.values[:, :, v] for v in visible]
            )
        plain.cache = cache
        return plain

    def fork(self, probe: bool) -> RoleBatch:
        raise RuntimeError("a packed batch is not shared")


def prefill_packed(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str] | set[str],
    shared: bool = False,
) -> RoleBatch | None:
    """Prefill one query's two contexts in one forward pass, as one packed sequence that is
    then decoded in one pass per step (:class:`_PackedBatch`; rows in ``roles`` order).

    The pass runs the longer prompt, then the shorter one's part after the head they share
    (positions restart at the head; a 4D mask keeps the two apart, computed as two causal
    products by :func:`.sdpa.few_query_attention`): about the cost of the longer prompt
    alone. None where this does not apply (not one query with two contexts, a shared-prefill
    store active unless ``shared``, attention other than ``tokrag_sdpa``, caches that are
    not full attention, sliding windows, retrieved positions in the shorter prompt past the
    shared head); the caller checks ``Speed.packed_prefill``.
    """
    if len(per_query) != 1 or len(roles) != 2:
        return None
    if _SHARED_PREFILL.get() is not None and not shared:
        return None
    if getattr(lm.model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return None
    specs = [per_query[0].get(r) for r in roles]
    if any(s is None or not s.ids for s in specs):
        return None
    if has_sliding_window(lm.model):
        return None  # the 4D mask below would replace the sliding-window mask of those layers
    cache = new_cache(lm.model)
    if not cache.layers or any(not isinstance(layer, GrowableLayer) for layer in cache.layers):
        return None
    ids = [list(s.ids) for s in specs]  # type: ignore[union-attr]
    lo = 0 if len(ids[0]) >= len(ids[1]) else 1  # the longer prompt runs first
    so = 1 - lo
    long_ids, short_ids = ids[lo], ids[so]
    h = len(os.path.commonprefix([long_ids, short_ids]))  # the head both share
    h = min(h, len(short_ids) - 1)  # the short prompt's last token must run (its logits)
    if any(p >= h for p in specs[so].rt_positions):  # type: ignore[union-attr]
        return None  # its retrieved positions would not be its cache positions
    probe = any(role in probe_roles for role in roles)
    if probe and not install_taps(model_parts(lm.model)):
        return None  # positions are probed through the layer taps only
    r = len(long_ids)
    n_seq = r + len(short_ids) - h
    dev = lm.model.device
    seq = torch.tensor([long_ids + short_ids[h:]], dtype=torch.long, device=dev)
    pos = torch.cat([torch.arange(r), torch.arange(h, len(short_ids))]).to(dev)[None]
    full = torch.ones(n_seq, n_seq, dtype=torch.bool, device=dev).tril_()
    full[r:, h:r] = False  # the short context sees the shared head, not the rest
    last = {lo: r - 1, so: n_seq - 1}
    keep = [last[0], last[1]]
    visible = torch.zeros((2, n_seq), dtype=torch.long, device=dev)
    visible[lo, :r] = 1
    visible[so, :h] = 1
    visible[so, r:] = 1

    batch = object.__new__(_PackedBatch)
    batch.role = "+".join(roles)
    batch.query_idx = [0, 0]
    batch.specs = list(specs)  # type: ignore[arg-type]
    batch.lm = lm
    batch.probe = probe
    batch.parts = model_parts(lm.model) if probe else None
    batch.pad = [0, 0]
    batch.ids = seq
    batch.mask = visible
    batch.cache = cache
    batch.records = None
    batch._next = torch.tensor([len(x) for x in ids], dtype=torch.long, device=dev)
    token = PACKED_PREFILL.set((r, h))
    try:
        logits = batch._run(
            seq, pos, full[None, None], keep=torch.tensor(keep, device=dev), positions=keep
        )
    finally:
        PACKED_PREFILL.reset(token)
    batch.logits = logits[0]
    return batch


def prefill(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str],
    speed: Speed,
    pack: bool = True,
) -> Prefilled:
    """The decoder's prefill with the speed paths: one packed
    sequence for one query's two contexts (unless ``pack`` is False: a query joining a
    running decode is prefilled as rows that :func:`join_batches` can merge), else all
    roles fused into one batch (a 2-row pass costs about what a 1-row pass does on a CPU),
    else one batch per role; each as the decode's ``speed`` allows. Fusion is also off where
    :func:`.install.fusion_off_reason` gives a reason; packing where ``speed.cpu_kernels`` is
    ``off`` (it is the ``tokrag_sdpa`` attention's: the decode runs the stock paths)."""
    fuse = speed.fuse and fusion_off_reason(lm.model) is None
    pack = pack and speed.packed_prefill and speed.cpu_kernels != "off"
    packed = prefill_packed(roles, per_query, lm, probe_roles) if fuse and pack else None
    if packed is not None:
        rows = {role: {0: (packed, r)} for r, role in enumerate(roles)}
        return Prefilled({packed.role: packed}, rows, fused=True, packed=True)
    split = (
        split_prefill(
            roles, per_query, lm, probe_roles, fuse, speed.packed_prefill and speed.cpu_kernels != "off"
        )
        if speed.split_prefill
        else None
    )
    if split is not None:
        return split
    batches = prefill_roles(roles, per_query, lm, probe_roles)
    reused = reused_seconds(batches)
    rows = {role: [(b, r) for r in range(len(b.query_idx))] for role, b in batches.items()}
    fused = _fused_prefill(rows, reused) if fuse else None
    return fused or Prefilled(batches, row_map(batches), reused_s=reused)


def _fused_prefill(
    rows: dict[str, list[tuple[RoleBatch, int]]], reused_s: float
) -> Prefilled | None:
    """Every role's rows (``(batch, row)``, roles in order) in one batch (:func:`fuse_rows`),
    with role -> query -> (that batch, row); None for one role or rows that cannot share it."""
    used = [role for role in rows if rows[role]]
    fused = fuse_rows([e for role in used for e in rows[role]]) if len(used) > 1 else None
    if fused is None:
        return None
    row_of: dict[str, dict[int, tuple[RoleBatch, int]]] = {}
    start = 0
    for role in used:
        n = len(rows[role])
        row_of[role] = {
            q: (fused, start + i) for i, q in enumerate(fused.query_idx[start : start + n])
        }
        start += n
    return Prefilled({fused.role: fused}, row_of, fused=True, reused_s=reused_s)


#: On CPU a batch's queries are prefilled in groups of at most this many prompt positions
#: (queries × the group's longest prompt; a longer query is a group of its own), then merged
#: into one batch: a padded many-prompt pass costs more per query than one prompt at a time
#: there (docs/results.md, "Prefill a few prompts at a time").
SPLIT_PREFILL_TOKENS = 512


def prefill_groups(
    per_query: Sequence[dict[str, ContextSpec]], tokens: int | None = None
) -> list[list[int]]:
    """Consecutive queries in groups whose padded prompt positions (queries × longest
    prompt) stay within ``tokens`` (default :data:`SPLIT_PREFILL_TOKENS`); every group holds
    at least one query."""
    tokens = SPLIT_PREFILL_TOKENS if tokens is None else tokens
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for q, contexts in enumerate(per_query):
        n = max((len(s.ids) for s in contexts.values()), default=0)
        if cur and (len(cur) + 1) * max(longest, n) > tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(q)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def split_prefill(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str],
    fuse: bool,
    pack: bool = True,
) -> Prefilled | None:
    """The prefill of several queries on CPU as :func:`prefill_groups` groups, each prefilled
    on its own, then merged (:func:`fuse_rows`): every role into one batch, all roles into
    one where ``fuse``, in ``roles`` order (a fused batch is all pure rows, then all RAG
    rows, as when prefilled together). A query alone in its group is prefilled as one packed
    sequence where ``pack`` and it applies (:func:`prefill_packed`, then unpacked), else with
    :func:`..contexts.prefill.prefill_roles`. Every row computes what it computes in a prefill
    of its own query. None where it does not apply (not on CPU, one group, or rows that
    cannot be merged): the caller prefills the queries as one batch."""
    if lm.model.device.type != "cpu":
        return None
    groups = prefill_groups(per_query)
    if len(groups) < 2:
        return None
    entries: dict[str, list[tuple[RoleBatch, int]]] = {role: [] for role in roles}
    reused = 0.0
    for g in groups:
        here = [r for r in roles if any(r in per_query[q] for q in g)]
        one = None
        if fuse and pack and len(g) == 1:
            # Packed even inside the harness's shared-prefill store (``shared``): its rows are
            # then not offered to the other policies, which prefill their own (each policy
            # is charged its own prefill either way).
            one = prefill_packed(here, [per_query[g[0]]], lm, probe_roles, shared=True)
        if isinstance(one, _PackedBatch):  # its cache layers are GrowableLayers
            rows = one.unpacked()
            rows.query_idx = [g[0]] * len(here)
            for r, role in enumerate(here):
                entries[role].append((rows, r))
            continue
        batches = prefill_roles(here, [per_query[q] for q in g], lm, probe_roles)
        reused += reused_seconds(batches)
        for role, b in batches.items():
            b.query_idx = [g[q] for q in b.query_idx]  # rebound, never written in place
            entries[role] += [(b, r) for r in range(len(b.query_idx))]
    fused = _fused_prefill(entries, reused) if fuse else None
    if fused is not None:
        return fused
    merged: dict[str, RoleBatch] = {}
    for role in [role for role in roles if entries[role]]:
        one_role = fuse_rows(entries[role])
        if one_role is None:
            return None
        one_role.role = role
        merged[role] = one_role
    return Prefilled(merged, row_map(merged), reused_s=reused)


def join_batches(running: RoleBatch, new: RoleBatch) -> RoleBatch | None:
    """One batch holding the rows of a running batch and then those of a newly prefilled
    one (a query joining a decode at a step boundary), so that a step stays one forward
    pass: :func:`fuse_batches` after giving each batch's prompt ids the width of its mask.
    A running packed one-query batch is unpacked into two rows first
    (:meth:`_PackedBatch.unpacked`). Every row computes what it computed before, up to the
    rounding of a different batch shape. None where they cannot share one: caches that
    cannot drop rows, or batches probed differently."""
    if isinstance(running, _PackedBatch) and all(
        isinstance(x, GrowableLayer) for x in running.cache.layers
    ):
        running = running.unpacked()
    if running.probe != new.probe or not (running.can_keep_rows() and new.can_keep_rows()):
        return None
    pad = running.lm.pad_token_id
    for b in (running, new):
        extra = b.mask.shape[1] - b.ids.shape[1]
        if extra > 0:  # positions decoded since the prefill: their ids are not needed again
            b.ids = torch.cat([b.ids, b.ids.new_full((b.ids.shape[0], extra), pad)], dim=1)
    merged = fuse_batches([running, new])
    if merged is not None:
        merged.role = running.role
    return merged
