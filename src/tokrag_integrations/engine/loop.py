"""The multi-context greedy loop.

Every policy (``llm``, ``rag``, ``tokrag``, ``cad``...) is a rule over the same loop: each
query owns one or more *contexts* (the pure prompt, the RAG prompt, one prompt per
passage...), every context keeps its own KV cache, all contexts of a query share the
generated suffix, and at each step the policy turns the contexts' next-token logits into one
token. Contexts of the same role across a batch of queries are left-padded and run as one
batch, so a step costs one forward pass per role. How the contexts are prefilled (and
whether they are fused into one batch) is the ``prefill`` argument: the runner passes the
speed path of :mod:`..accel`; this module never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from ..models import LoadedModel
from ..policies.base import Policy
from ..prompts import PromptPlan
from .batch import RoleBatch
from .decoder import (
    DROP_SHARE,
    ChooseFn,
    Decoder,
    PrefillFn,
    StepEvent,
    role_setup,
    step_event,
    views_for,
)
from .prefill import row_map
from .view import ContextView

__all__ = [
    "DROP_SHARE", "ChooseFn", "Decoder", "PrefillFn", "StepEvent", "decode_loop", "role_setup",
    "step_event", "teacher_force", "views_for",
]


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    prefill: PrefillFn | None = None,
    choose_many: ChooseFn | None = None,
) -> Iterator[StepEvent]:
    """Greedy multi-context decoding of a batch of queries under one policy, step by step.

    Yields one :class:`StepEvent` per chosen token as soon as it is chosen (the final event
    of a query has ``finished=True`` and its ``stop_reason``: ``eos``, ``stop`` or
    ``length``). EOS tokens end a query and are not yielded as text. ``prefill`` builds the
    batches (default :func:`.prefill.plain_prefill`, one batch per role) and
    ``choose_many`` makes the choices of a step with several queries (default
    ``policy.choose_many``); the runner (:func:`..runner.decode_loop`) passes those of
    :mod:`..accel` that its ``speed=`` asks for, and picks blockwise verification there.
    A sequence-level rule (``policy.sequence_level``) is decoded by
    :func:`.sequence.decode_sequence` instead.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if policy.sequence_level:
        raise ValueError(
            f"policy {policy.name!r} is sequence-level: decode it with "
            "engine.sequence.decode_sequence (or runner.decode_loop, which picks it)"
        )
    # A rule that owns its decoding altogether.
    if policy.decode is not None:
        yield from policy.decode(lm, plans, max_new_tokens=max_new_tokens, stop=stop, timings=timings)
        return
    timings = timings if timings is not None else {}
    d = Decoder(
        lm, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings,
        prefill=prefill, choose_many=choose_many,
    )
    d.admit(plans)
    t1 = time.perf_counter()
    # Every query of a step chosen at once (the speed paths may share work between them:
    # one logit-lens product for every query whose contexts disagree), then one forward
    # pass per batch.
    while d.active:
        yield from d.choose()
        d.advance()
    timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1


def teacher_force(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    targets: Sequence[Sequence[int]],
) -> Iterator[tuple[int, int, dict[str, ContextView]]]:
    """Walk every query's contexts along a fixed continuation (teacher forcing).

    The same contexts, KV caches and probes as :func:`decode_loop` (each role prefilled on
    its own, no fusion), but instead of letting ``policy`` choose, token ``targets[q][i]``
    is fed to all contexts of query ``q`` after step ``i``. Yields ``(query_idx, i,
    views)`` where the views' logits predict ``targets[q][i]``; consume the views before
    advancing the iterator (the next step overwrites them). Used for gold-continuation
    scoring (token-level AUC) and RAG-Sequence's cross-scoring.
    """
    if len(plans) != len(targets):
        raise ValueError(f"got {len(plans)} plans but {len(targets)} target sequences")
    per_query, roles = role_setup(lm, plans, policy)
    n_steps = max((len(t) for t in targets), default=0)
    if n_steps == 0:
        return
    with torch.inference_mode():
        batches: dict[str, RoleBatch] = {}
        for role in roles:
            members = [(q, c[role]) for q, c in enumerate(per_query) if role in c]
            b = RoleBatch(role, members, lm, probe=role in policy.probe_roles)
            b.forward(None)
            batches[role] = b
        rows = row_map(batches)
        for i in range(n_steps):
            for q in range(len(plans)):
                if i < len(targets[q]):
                    yield q, i, views_for(rows, q)
            if i == n_steps - 1:
                break
            new = torch.tensor(
                [int(t[i]) if i < len(t) else lm.pad_token_id for t in targets], dtype=torch.long
            )
            for b in batches.values():
                b.forward(new[b.query_idx])
