"""Prefilling the role batches of a decode: prompt-head reuse between roles and the
evaluation harness's shared-prefill store."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..models import LoadedModel
from ..policies.base import ContextSpec
from .batch import RoleBatch

_SHARED_PREFILL: contextvars.ContextVar[dict[tuple[Any, ...], RoleBatch] | None] = (
    contextvars.ContextVar("tokrag_shared_prefill", default=None)
)


@contextlib.contextmanager
def shared_prefill() -> Iterator[dict[tuple[Any, ...], RoleBatch]]:
    """Within this block, decodes of identical contexts (same role, same ids, same batch) reuse
    one prefill: the first decode keeps its prefilled role batch, later ones get a copy of its
    KV cache (and their timings, ``prefill_reused_s``, the seconds that prefill took). Used
    by the evaluation harness to run several policies on the same prompts."""
    store: dict[tuple[Any, ...], RoleBatch] = {}
    token = _SHARED_PREFILL.set(store)
    try:
        yield store
    finally:
        _SHARED_PREFILL.reset(token)
        store.clear()


def _prefilled(
    role: str,
    members: list[tuple[int, ContextSpec]],
    lm: LoadedModel,
    probe: bool,
    prefix_src: RoleBatch | None = None,
) -> RoleBatch:
    """A prefilled role batch, from the shared-prefill store when one is active.

    With ``prefix_src`` (an already prefilled batch of another role holding the same queries)
    the prompt head both contexts share is taken from its KV cache and only the rest of this
    role's prompt is run (:meth:`RoleBatch.prefill_from`).
    """
    store = _SHARED_PREFILL.get()
    key = (id(lm.model), tuple((q, tuple(s.ids)) for q, s in members))
    if store is not None:
        for p in (True,) if probe else (False, True):
            if (key, p) in store:
                twin = store[(key, p)].fork(probe)
                # What the prefill cost the decode that ran it (this one reuses it).
                twin.reused_s = twin.prefill_s
                return twin
    t0 = time.perf_counter()
    b = RoleBatch(role, members, lm, probe=probe)
    h = b.shared_prefix(prefix_src) if prefix_src is not None else 0
    if h:
        b.prefill_from(prefix_src, h)  # type: ignore[arg-type]
    else:
        b.forward(None)
    b.prefill_s, b.reused_s = time.perf_counter() - t0, 0.0
    if store is not None:
        store[(key, probe)] = b.fork(probe)
    return b


def reused_seconds(batches: dict[str, RoleBatch]) -> float:
    """Seconds of prefill that ``batches`` took from the shared-prefill store instead of
    running it (what decoding alone would have paid for them)."""
    return sum(getattr(b, "reused_s", 0.0) for b in batches.values())


def prefill_roles(
    roles: Sequence[str],
    per_query: Sequence[dict[str, ContextSpec]],
    lm: LoadedModel,
    probe_roles: frozenset[str] | set[str],
) -> dict[str, RoleBatch]:
    """Prefill every role's batch (in ``roles`` order in the returned dict).

    The longest context is run first; a context whose prompt starts with the same head as
    it (the pure prompt is head + question, the RAG prompt head + passages + question)
    reuses that head's keys and values instead of recomputing them.
    """
    members = {
        role: [(q, c[role]) for q, c in enumerate(per_query) if role in c] for role in roles
    }
    order = sorted(roles, key=lambda r: -sum(len(s.ids) for _, s in members[r]))
    done: dict[str, RoleBatch] = {}
    for role in order:
        src = done[order[0]] if done else None
        done[role] = _prefilled(role, members[role], lm, role in probe_roles, prefix_src=src)
    return {role: done[role] for role in roles}


@dataclass
class Prefilled:
    """The prefilled batches of a decode: ``batches`` are advanced at every step, ``rows``
    says where each context lives (role -> query -> (batch, row)); ``fused`` / ``packed``:
    whether all contexts share one batch / one packed sequence (reported in the timings)."""

    batches: dict[str, RoleBatch]
    rows: dict[str, dict[int, tuple[RoleBatch, int]]] = field(default_factory=dict)
    fused: bool = False
    packed: bool = False
    #: Prefill seconds taken from the shared-prefill store (:func:`reused_seconds`).
    reused_s: float = 0.0


def row_map(batches: dict[str, RoleBatch]) -> dict[str, dict[int, tuple[RoleBatch, int]]]:
    """role -> query -> (its batch, its row) for one batch per role."""
    return {role: {q: (b, r) for r, q in enumerate(b.query_idx)} for role, b in batches.items()}
