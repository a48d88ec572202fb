"""The one multi-context greedy loop.

Every policy (``llm``, ``rag``, ``tokrag``, ``cad``...) is a rule over the same loop: each
query owns one or more *contexts* (the pure prompt, the RAG prompt, one prompt per
passage...), every context keeps its own KV cache, all contexts of a query share the
generated suffix, and at each step the policy turns the contexts' next-token logits into one
token. Contexts of the same role across a batch of queries are left-padded and run as one
batch, so a step costs one forward pass per role.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import (
    ModelParts,
    Probe,
    ProbeRecord,
    install_taps,
    model_parts,
)
from .models import LoadedModel, cache_argument, model_cache

# The policy contract lives in :mod:`.policies.base`; imported here too, so that
# ``from tokrag_integrations.decoding import Policy, ContextView, Choice, ContextSpec`` works.
from .policies.base import Choice, ContextSpec, ContextView, Policy
from .prompts import PromptPlan
from .trace import Candidate, TraceStep


def distribution_stats(logits: torch.Tensor, token_id: int) -> dict[str, float]:
    """Per-step summary of one next-token distribution, O(V), for the confidence metrics.

    ``logits`` [V] -> ``{"logp": log p(y), "entropy": -sum p log p, "gini": sum p^2,
    "mean_logp": (1/V) sum_v log p(v)}`` (float). DP (exp entropy) and Self-Certainty
    (-log V - mean_logp) are derived from these (Confident RAG, Eq. 2-6). ``mean_logp``
    uses log-probabilities clamped at -1e4 so a masked (-inf) logit cannot make it -inf.
    """
    return distribution_stats_rows(logits[None], token_id)[0][0]


def distribution_stats_rows(
    logits: torch.Tensor, token_id: int
) -> tuple[list[dict[str, float]], torch.Tensor]:
    """:func:`distribution_stats` of several distributions at once (``logits`` [N, V]); also
    returns their probabilities [N, V] (the exponentials the statistics are made of)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    clamped = logp.clamp(min=-1e4)
    vals = torch.stack(
        [
            logp[:, int(token_id)],
            -(p * clamped).sum(-1),
            (p * p).sum(-1),
            clamped.mean(-1),
        ],
        dim=1,
    ).tolist()
    names = ("logp", "entropy", "gini", "mean_logp")
    return [dict(zip(names, row, strict=True)) for row in vals], p


class _RoleBatch:
    """All contexts of one role across the batch of queries, with their KV cache."""

    def __init__(
        self, role: str, members: list[tuple[int, ContextSpec]], lm: LoadedModel, probe: bool
    ):
        from .kv_cache import new_cache

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

    def cache_row(self, row: int) -> int:
        """The KV-cache row holding ``row``'s keys (one per row here; a packed batch keeps
        all its contexts in one)."""
        return row

    def fork(self, probe: bool) -> _RoleBatch:
        """A copy that can advance independently (own KV cache; other tensors are rebound,
        never written in place). ``probe=False`` drops the probes of a probed prefill."""
        twin = object.__new__(_RoleBatch)
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
            pos = self._append(inp.shape[1])
        self._call(inp, pos, 1, probe=self.probe)

    def shared_prefix(self, src: _RoleBatch) -> int:
        """Length of the prompt head every row shares with its query's row in ``src`` (0
        when it cannot be reused: rows of unequal length, a query missing from ``src``, a
        cache kind other than full attention, or fewer than ``MIN_SHARED_PREFIX`` tokens)."""
        from .kv_cache import is_full_layer

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

    def prefill_from(self, src: _RoleBatch, h: int) -> None:
        """Prefill with the first ``h`` positions' keys and values copied from ``src`` (whose
        rows' prompts start with the same ``h`` tokens), running only the remaining tokens.
        The same numbers as :meth:`forward` up to the rounding of a different batch shape."""
        from .kv_cache import new_cache

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
        self._call(self.ids[:, h:], pos, 1, probe=self.probe)

    def extend(self, new_ids: torch.Tensor) -> torch.Tensor:
        """Advance every row by ``k`` tokens ([B, k] long) in one forward pass, without
        probes; returns the logits of all ``k`` positions, [B, k, V] float. With ``k = 1``
        this is the same call as :meth:`forward` (the same numbers)."""
        new_ids = new_ids.to(self.ids.device)
        k = new_ids.shape[1]
        return self._call(new_ids, self._append(k), k, probe=False)

    def _append(self, k: int) -> torch.Tensor:
        """Extend every row's mask by ``k`` valid positions; their position ids, [B, k]."""
        base = self.mask.sum(-1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1]).expand(-1, k)], dim=1)
        return (base + torch.arange(k, device=base.device)).clamp(min=0)

    def _call(
        self, inp: torch.Tensor, pos: torch.Tensor, keep: int, *, probe: bool
    ) -> torch.Tensor:
        """One forward pass over ``inp`` with the cache; keeps the last ``keep`` positions'
        logits ([B, keep, V] float, returned; the last one also in ``self.logits``)."""
        logits = self._model_pass(
            dict(input_ids=inp, attention_mask=self.mask, position_ids=pos, logits_to_keep=keep),
            probe=probe,
        )
        self.logits = logits[:, -1, :]
        return logits

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

    def rollback(self, stale: Sequence[int]) -> None:
        """Forget the last ``stale[r]`` positions of each row: the positions all rows share
        are cropped from the KV cache; the rest are masked out (they stay in the cache as
        holes that no later position attends to and that take no position id)."""
        m = min(stale, default=0)
        if m:
            self.cache.crop(-m)
            self.mask = self.mask[:, :-m]
        if any(s > m for s in stale):
            mask = self.mask.clone()
            for r, s in enumerate(stale):
                if s > m:
                    mask[r, mask.shape[1] - (s - m) :] = 0
            self.mask = mask


def fuse_batches(batches: Sequence[_RoleBatch]) -> _RoleBatch | None:
    """One batch holding the rows of several prefilled role batches, so that a decode step
    is one forward pass instead of one per role.

    Each batch is left-padded to the longest (padding positions are masked, hold zero keys
    and take no position id), so every row computes what it computed alone, up to the
    rounding of a different kernel. Returns None where rows cannot share a batch: caches
    that are not full-attention (sliding windows), or roles probed differently.
    """
    from .attention import ProbeRecord
    from .kv_cache import GrowableLayer, is_full_layer, new_cache

    if len(batches) < 2 or len({b.probe for b in batches}) != 1:
        return None
    if any(not is_full_layer(layer) for b in batches for layer in b.cache.layers):
        return None
    if any(b.probe and b.records is None for b in batches):
        return None
    first = batches[0]
    n = max(b.mask.shape[1] for b in batches)
    fused = object.__new__(_RoleBatch)
    fused.__dict__.update(first.__dict__)
    fused.role = "+".join(b.role for b in batches)
    fused.query_idx = [q for b in batches for q in b.query_idx]
    fused.specs = [s for b in batches for s in b.specs]
    fused.pad = [p + n - b.mask.shape[1] for b in batches for p in b.pad]

    def left(x: torch.Tensor, extra: int, value: float, dim: int) -> torch.Tensor:
        if not extra:
            return x
        shape = list(x.shape)
        shape[dim] = extra
        return torch.cat([x.new_full(shape, value), x], dim=dim)

    fused.ids = torch.cat(
        [left(b.ids, n - b.mask.shape[1], first.lm.pad_token_id, 1) for b in batches]
    )
    fused.mask = torch.cat([left(b.mask, n - b.mask.shape[1], 0, 1) for b in batches])
    fused.logits = torch.cat([b.logits for b in batches])
    cache = new_cache(first.lm.model)
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, GrowableLayer):  # pragma: no cover - guarded above
            return None
        # Each role's cache covers its mask (a fresh prefill: the mask's length).
        layer.set_left_padded(
            [b.cache.layers[i].keys for b in batches], [b.cache.layers[i].values for b in batches]
        )
    fused.cache = cache
    if first.probe:
        fused.records = ProbeRecord.cat([b.records for b in batches])  # type: ignore[misc]
    return fused


_SHARED_PREFILL: contextvars.ContextVar[dict[tuple[Any, ...], _RoleBatch] | None] = (
    contextvars.ContextVar("tokrag_shared_prefill", default=None)
)


@contextlib.contextmanager
def shared_prefill() -> Iterator[dict[tuple[Any, ...], _RoleBatch]]:
    """Within this block, decodes of identical contexts (same role, same ids, same batch) reuse
    one prefill: the first decode keeps its prefilled role batch, later ones get a copy of its
    KV cache. Used by the evaluation harness to run several policies on the same prompts."""
    store: dict[tuple[Any, ...], _RoleBatch] = {}
    token = _SHARED_PREFILL.set(store)
    try:
        yield store
    finally:
        _SHARED_PREFILL.reset(token)
        store.clear()


#: Shortest shared prompt head worth reusing from another context's prefill.
MIN_SHARED_PREFIX = 8


def _prefilled(
    role: str,
    members: list[tuple[int, ContextSpec]],
    lm: LoadedModel,
    probe: bool,
    prefix_src: _RoleBatch | None = None,
) -> _RoleBatch:
    """A prefilled role batch, from the shared-prefill store when one is active.

    With ``prefix_src`` (an already prefilled batch of another role holding the same queries)
    the prompt head both contexts share is taken from its KV cache and only the rest of this
    role's prompt is run (:meth:`_RoleBatch.prefill_from`).
    """
    store = _SHARED_PREFILL.get()
    key = (id(lm.model), tuple((q, tuple(s.ids)) for q, s in members))
    if store is not None:
        for p in (True,) if probe else (False, True):
            if (key, p) in store:
                return store[(key, p)].fork(probe)
    b = _RoleBatch(role, members, lm, probe=probe)
    h = b.shared_prefix(prefix_src) if prefix_src is not None else 0
    if h:
        b.prefill_from(prefix_src, h)  # type: ignore[arg-type]
    else:
        b.forward(None)
    if store is not None:
        store[(key, probe)] = b.fork(probe)
    return b


def prefill_roles(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str] | set[str],
) -> dict[str, _RoleBatch]:
    """Prefill every role's batch (in ``roles`` order in the returned dict).

    The longest context is run first; a context whose prompt starts with the same head as
    it (the pure prompt is head + question, the RAG prompt head + passages + question)
    reuses that head's keys and values instead of recomputing them.
    """
    members = {
        role: [(q, c[role]) for q, c in enumerate(per_query) if role in c] for role in roles
    }
    order = sorted(roles, key=lambda r: -sum(len(s.ids) for _, s in members[r]))
    done: dict[str, _RoleBatch] = {}
    for role in order:
        src = done[order[0]] if done else None
        done[role] = _prefilled(role, members[role], lm, role in probe_roles, prefix_src=src)
    return {role: done[role] for role in roles}


def packed_prefill_enabled() -> bool:
    """Whether one query's two contexts are decoded as one packed sequence
    (``TOKRAG_PACKED_PREFILL``, default on; ``0`` prefills each context on its own and
    decodes them as a fused two-row batch)."""
    return os.environ.get("TOKRAG_PACKED_PREFILL", "1").strip().lower() not in ("0", "false", "off", "no")


class _PackedBatch(_RoleBatch):
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
        self._step(new_ids.view(1, 2).to(dev), pos, t + 2)

    def _step(self, inp: torch.Tensor, pos: torch.Tensor, n: int) -> None:
        visible = self.mask[:, :n].bool()
        # Additive: 0 where a context sees a key, -inf elsewhere (the CPU flash path).
        mask = torch.zeros(visible.shape, dtype=self.lm.model.dtype, device=visible.device)
        mask = mask.masked_fill_(~visible, float("-inf"))[None, None]
        logits = self._run(inp, pos, mask, keep=inp.shape[1], positions=[0, 1])
        self.logits = logits[0]

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

    def extend(self, new_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a packed batch advances one token per context at a time")

    def fork(self, probe: bool) -> _RoleBatch:
        raise RuntimeError("a packed batch is not shared")

    def rollback(self, stale: Sequence[int]) -> None:
        """Forget each context's last ``k`` tokens (the same ``k`` for both)."""
        if len(set(stale)) != 1:
            raise ValueError(f"a packed batch rolls both contexts back alike, got {list(stale)}")
        k = int(stale[0])
        if k:
            self.cache.crop(-2 * k)
            self.mask = self.mask[:, : -2 * k]
            self._next = self._next - k


def prefill_packed(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str] | set[str],
) -> _RoleBatch | None:
    """Prefill one query's two contexts in one forward pass, as one packed sequence that is
    then decoded in one pass per step (:class:`_PackedBatch`; rows in ``roles`` order).

    The pure prompt is the RAG prompt's head plus the question, so the pass runs the longer
    prompt followed by the shorter one's part after the head they share; positions restart
    at the head for that part, and a 4D mask keeps the two apart (computed as two causal
    products by :func:`.cpu_kernels.few_query_attention`). Costs about what prefilling the
    longer prompt alone does: the short part rides in a pass that is compute-bound, instead
    of a pass of its own that reads every weight. Returns None where this does not apply
    (not one query with two contexts, a shared-prefill store active, attention other than
    this package's CPU path, caches that are not full attention, sliding-window layers,
    retrieved positions in the
    shorter prompt past the shared head, ``TOKRAG_PACKED_PREFILL=0``).
    """
    from .cpu_kernels import ATTN_IMPLEMENTATION, PACKED_PREFILL
    from .kv_cache import GrowableLayer, has_sliding_window, new_cache

    if len(per_query) != 1 or len(roles) != 2 or not packed_prefill_enabled():
        return None
    if _SHARED_PREFILL.get() is not None:
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
    h = 0
    for a, b in zip(long_ids, short_ids, strict=False):
        if a != b:
            break
        h += 1
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


@dataclass
class StepEvent:
    """A token chosen for query ``query_idx`` (yielded by :func:`decode_loop`)."""

    query_idx: int
    step: TraceStep
    finished: bool = False
    stop_reason: str = ""


def step_event(
    lm: LoadedModel,
    q: int,
    step_i: int,
    choice: Choice,
    views: dict[str, ContextView],
    generated: list[int],
    stop: Sequence[str],
    max_new_tokens: int,
) -> StepEvent:
    """The trace step of one chosen token and whether it ends the query (``generated`` is
    the query's token list so far; the token is appended unless it is EOS)."""
    tok = lm.tokenizer
    tid = int(choice.token_id)
    is_eos = tid in lm.eos_token_ids
    cands = {}
    stats = {}
    # Every context's statistics in one pass over its logits; its probabilities are kept for
    # the view (a rule that read them already has them).
    rows, probs = distribution_stats_rows(torch.stack([v.logits for v in views.values()]), tid)
    tops = torch.argmax(probs, dim=-1).tolist()
    for i, (role, v) in enumerate(views.items()):
        if v._probs is None:
            v._probs = probs[i]
        top = int(tops[i])
        cands[role] = Candidate(top, tok.decode([top]), float(v.probs[top].item()))
        stats[role] = rows[i]
    step = TraceStep(
        index=step_i,
        token_id=tid,
        text="" if is_eos else tok.decode([tid]),
        source=choice.source,
        candidates=cands,
        signals=choice.signals,
        stats=stats,
    )
    reason = ""
    if is_eos:
        reason = "eos"
    else:
        generated.append(tid)
        if stop:
            text = tok.decode(generated, skip_special_tokens=True)
            if any(s in text for s in stop):
                reason = "stop"
    if not reason and step_i == max_new_tokens - 1:
        reason = "length"
    return StepEvent(q, step, finished=bool(reason), stop_reason=reason)


def fuse_contexts() -> bool:
    """Whether multi-context rules decode all their contexts as one batch
    (``TOKRAG_FUSE_CONTEXTS``, default on; ``0`` decodes one batch per role)."""
    return os.environ.get("TOKRAG_FUSE_CONTEXTS", "1").strip().lower() not in ("0", "false", "off", "no")


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
) -> Iterator[StepEvent]:
    """Greedy multi-context decoding of a batch of queries under one policy, step by step.

    Yields one :class:`StepEvent` per chosen token as soon as it is chosen (the final event
    of a query has ``finished=True`` and its ``stop_reason``: ``eos``, ``stop`` or
    ``length``). EOS tokens end a query and are not yielded as text. Blockwise verification
    (``policy.speculative``) is chosen one level up, by :func:`.runner.decode_loop`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    # Sequence-level rules (RAG-Sequence) own their decoding and replay the chosen answer.
    if policy.decode is not None:
        yield from policy.decode(lm, plans, max_new_tokens=max_new_tokens, stop=stop, timings=timings)
        return
    policy.prepare(lm)
    per_query = [policy.contexts(p) for p in plans]
    roles = [r for r in policy.roles if any(r in c for c in per_query)]
    extra = sorted({r for c in per_query for r in c} - set(roles))
    roles += extra
    timings = timings if timings is not None else {}

    t0 = time.perf_counter()
    with torch.inference_mode():
        # All roles in one batch: one forward pass per step (on a CPU a 2-row pass costs
        # about what a 1-row pass does; the rows are the same computations).
        from .cpu_kernels import fusion_off_reason

        fuse = (
            fuse_contexts() and policy.fuse and fusion_off_reason(lm.model) is None
        )
        # One query's two contexts: one prefill pass over both (they share the prompt head).
        fused = prefill_packed(roles, per_query, lm, policy.probe_roles) if fuse else None
        packed = fused is not None
        row_of: dict[str, dict[int, tuple[_RoleBatch, int]]] = {}
        if fused is not None:
            batches = {fused.role: fused}
            row_of = {role: {0: (fused, r)} for r, role in enumerate(roles)}
        else:
            batches = prefill_roles(roles, per_query, lm, policy.probe_roles)
            fused = fuse_batches(list(batches.values())) if fuse else None
            start = 0
            for role, b in batches.items():
                row_of[role] = {
                    q: (fused, start + r) if fused is not None else (b, r)
                    for r, q in enumerate(b.query_idx)
                }
                start += len(b.query_idx)
            if fused is not None:
                batches = {fused.role: fused}
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        timings["fused"] = float(fused is not None)
        timings["packed"] = float(packed)

        generated: list[list[int]] = [[] for _ in plans]
        done = [False] * len(plans)
        t1 = time.perf_counter()
        for step_i in range(max_new_tokens):
            chosen = [lm.pad_token_id] * len(plans)
            for q in range(len(plans)):
                if done[q]:
                    continue
                views = {}
                for role, rows in row_of.items():
                    if q in rows:
                        b, r = rows[q]
                        # Built only when the rule reads it (most steps never do).
                        rec = (
                            (lambda recs=b.records, r=r: recs.select([r]))
                            if b.records is not None
                            else None
                        )
                        views[role] = ContextView(b, r, rec)
                choice = policy.choose(views, lm)
                chosen[q] = int(choice.token_id)
                ev = step_event(lm, q, step_i, choice, views, generated[q], stop, max_new_tokens)
                done[q] = ev.finished
                yield ev
            if all(done):
                break
            new = torch.tensor(chosen, dtype=torch.long)
            for b in batches.values():
                b.forward(new[b.query_idx])
        timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1


def teacher_force(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    targets: Sequence[Sequence[int]],
) -> Iterator[tuple[int, int, dict[str, ContextView]]]:
    """Walk every query's contexts along a fixed continuation (teacher forcing).

    The same contexts, KV caches and probes as :func:`decode_loop`, but instead of letting
    ``policy`` choose, token ``targets[q][i]`` is fed to all contexts of query ``q`` after step
    ``i``. Yields ``(query_idx, i, views)`` where the views' logits predict ``targets[q][i]``;
    consume the views before advancing the iterator (the next step overwrites them).
    Used for gold-continuation scoring (token-level AUC) and RAG-Sequence's cross-scoring.
    """
    if len(plans) != len(targets):
        raise ValueError(f"got {len(plans)} plans but {len(targets)} target sequences")
    policy.prepare(lm)
    per_query = [policy.contexts(p) for p in plans]
    roles = [r for r in policy.roles if any(r in c for c in per_query)]
    roles += sorted({r for c in per_query for r in c} - set(roles))
    n_steps = max((len(t) for t in targets), default=0)
    if n_steps == 0:
        return
    with torch.inference_mode():
        batches: dict[str, _RoleBatch] = {}
        for role in roles:
            members = [(q, c[role]) for q, c in enumerate(per_query) if role in c]
            b = _RoleBatch(role, members, lm, probe=role in policy.probe_roles)
            b.forward(None)
            batches[role] = b
        row_of = {role: {q: r for r, q in enumerate(b.query_idx)} for role, b in batches.items()}
        for i in range(n_steps):
            for q in range(len(plans)):
                if i >= len(targets[q]):
                    continue
                views = {}
                for role, rows in row_of.items():
                    if q in rows:
                        b = batches[role]
                        rec = b.records.select([rows[q]]) if b.records is not None else None
                        views[role] = ContextView(b, rows[q], rec)
                yield q, i, views
            if i == n_steps - 1:
                break
            new = torch.tensor(
                [int(t[i]) if i < len(t) else lm.pad_token_id for t in targets], dtype=torch.long
            )
            for b in batches.values():
                b.forward(new[b.query_idx])
