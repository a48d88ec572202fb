"""Which loop decodes a policy, and with which speed paths.

Blockwise verification (:func:`.accel.blockwise_loop`) where the policy asks for it
(``speculative=True``) and it applies (:func:`.accel.blockwise`); otherwise the step-by-step
loop :func:`.engine.loop.decode_loop` (which also runs a sequence-level rule's own
``decode``) with the packed / fused prefill of :func:`.accel.prefill`. All give the same
tokens, sources and signals. The choice is made here, above the engine and the speed paths,
so that the algorithm side (engine loop, policies, signals) never imports :mod:`.accel`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from . import accel
from .engine import loop
from .engine.loop import StepEvent
from .models import LoadedModel
from .policies.base import Policy
from .prompts import PromptPlan


def decode_loop(
    lm: LoadedModel,
    plans: Sequence[PromptPlan],
    policy: Policy,
    *,
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    timings: dict[str, float] | None = None,
) -> Iterator[StepEvent]:
    """Decode ``plans`` under ``policy`` with the loop that fits it; the events of
    :func:`.engine.loop.decode_loop` (the arguments are its arguments)."""
    if max_new_tokens >= 1 and policy.speculative and accel.blockwise(lm, policy):
        yield from accel.blockwise_loop(
            lm, plans, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings
        )
        return
    yield from loop.decode_loop(
        lm,
        plans,
        policy,
        max_new_tokens=max_new_tokens,
        stop=stop,
        timings=timings,
        prefill=accel.prefill,
    )
