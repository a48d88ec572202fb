"""Which loop decodes a policy, and with which speed paths (the ``speed=`` argument).

A sequence-level rule (RAG-Sequence) is decoded by :func:`.engine.sequence.decode_sequence`;
else the step-by-step loop
:func:`.engine.loop.decode_loop` with the packed / fused prefill of :func:`.accel.packed.prefill`
and, in a batch, the shared logit-lens product of :func:`.accel.shared_lens.choose_many`. All give the
same tokens, sources and signals. The choice is made here, above the engine and the speed
paths, so that the algorithm side (engine loop, policies, signals) never imports
:mod:`.accel`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .accel.packed import join_batches, prefill
from .accel.shared_lens import choose_many
from .engine import loop
from .engine.decoder import Decoder
from .engine.loop import StepEvent
from .engine.sequence import decode_sequence
from .engine.speed import Speed, speed_of
from .models import LoadedModel
from .policies.base import Policy
from .prompts import PromptPlan


def resolve_speed(speed: Speed | str | Mapping[str, Any] | None, policy: Policy) -> Speed:
    """The :class:`Speed` of a decode: ``speed`` (None: ``"auto"``), with the speed options
    a policy was given the deprecated way (``TokRAG(fuse=False)``) applied where
    ``speed`` is None.

    Raises:
        ValueError: ``speed`` given together with other deprecated speed options of the
            policy.
    """
    legacy = policy.legacy_speed
    if not legacy:
        return speed_of(speed)
    if speed is not None and speed_of(speed) != speed_of(legacy):
        raise ValueError(
            f"give the speed once: speed={speed!r}, or the policy's deprecated options "
            f"{legacy!r}, not both"
        )
    return speed_of(legacy)


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
) -> Iterator[StepEvent]:
    """Decode ``plans`` under ``policy`` with the loop that fits it; the events of
    :func:`.engine.loop.decode_loop` (the arguments are its arguments, and ``speed``:
    a :class:`.engine.speed.Speed`, a preset name or a dict, see :func:`resolve_speed`)."""
    chosen = resolve_speed(speed, policy)
    kwargs = {"max_new_tokens": max_new_tokens, "stop": stop, "timings": timings}
    if policy.sequence_level:
        yield from decode_sequence(lm, plans, policy, **kwargs)
        return
    yield from loop.decode_loop(
        lm,
        plans,
        policy,
        prefill=functools.partial(prefill, speed=chosen),
        choose_many=choose_many if chosen.share_lens else None,
        **kwargs,
    )


def continuous_supported(policy: Policy, speed: Speed | str | Mapping[str, Any] | None = None) -> bool:
    """Whether queries can join a running decode of ``policy`` (:func:`decoder`): a
    step-by-step rule (not sequence-level, no decoding of its own)."""
    return not (policy.sequence_level or policy.decode is not None)


def decoder(
    lm: LoadedModel,
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
    speed: Speed | str | Mapping[str, Any] | None = None,
) -> Decoder:
    """A :class:`.engine.decoder.Decoder` with the speed paths ``speed`` asks for: queries
    admitted alone are prefilled as :func:`decode_loop` does; a query admitted while others
    decode is prefilled as plain rows and merged into the running batch
    (:func:`.accel.packed.join_batches`) where contexts are fused. Raises ``ValueError`` where
    :func:`continuous_supported` is False."""
    chosen = resolve_speed(speed, policy)
    if not continuous_supported(policy, chosen):
        raise ValueError(f"policy {policy.name!r} with speed {chosen.options()} cannot admit queries while decoding")
    return Decoder(
        lm,
        policy,
        max_new_tokens=max_new_tokens,
        stop=stop,
        timings=timings,
        prefill=functools.partial(prefill, speed=chosen),
        join_prefill=functools.partial(prefill, speed=chosen, pack=False),
        choose_many=choose_many if chosen.share_lens else None,
        join=join_batches if chosen.fuse else None,
    )
