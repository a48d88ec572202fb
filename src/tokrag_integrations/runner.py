"""Which loop decodes a policy.

Blockwise verification (:func:`.speculative.blockwise_loop`) where the policy asks for it
(``speculative=True``) and :func:`.speculative.blockwise_supported` says it applies; otherwise
the step-by-step loop :func:`.decoding.decode_loop` (which also runs a sequence-level rule's
own ``decode``). Both give the same tokens, sources and signals. The choice is made here,
above both loops, so that :mod:`.decoding` does not import :mod:`.speculative`, which is
built on it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from . import decoding
from .decoding import Policy, StepEvent
from .models import LoadedModel
from .prompts import PromptPlan
from .speculative import blockwise_loop, blockwise_supported


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
    :func:`.decoding.decode_loop` (the arguments are its arguments)."""
    if max_new_tokens >= 1 and policy.speculative and blockwise_supported(lm, policy):
        yield from blockwise_loop(
            lm, plans, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings
        )
        return
    yield from decoding.decode_loop(
        lm, plans, policy, max_new_tokens=max_new_tokens, stop=stop, timings=timings
    )
