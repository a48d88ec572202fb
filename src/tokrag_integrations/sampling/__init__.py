"""Sampling and log-probabilities of the engine's tokens (issue 57), a leaf package: torch
and the standard library only, so that the engine and the device step (``accel``) share it.
Here the per-query settings (:class:`Sampling`, :func:`sampling_of`); the draw and the
log-probabilities in :mod:`.gumbel`; the constraints' protocol and bitmask in
:mod:`.constraints`.

A decoding rule chooses, at every step, the distribution its token comes from
(:attr:`.policies.base.Choice.logits`: the pure context's, the RAG context's, CAD's contrast,
RAG-Token's mixture...). Greedy decoding (``temperature=0``, the default) takes that
distribution's argmax, which is the rule's own token. With ``temperature > 0`` the token is
drawn from it by :func:`draw`:

    y ~ softmax(z / T) restricted to the top-k tokens and to the smallest set of tokens whose
    probability reaches top-p (nucleus sampling, Holtzman et al., 2020),

by the Gumbel-max trick (Gumbel, 1954; Maddison et al., 2014): y = argmax_v z_v / T + g_v
over the kept tokens, with g_v = -log(-log u_v) and u_v uniform in (0, 1). The noise u_v is
a counter-based hash of (seed, step, v) (no generator state, as in Salmon et al., 2011,
"Parallel random numbers: as easy as 1, 2, 3"): a query's tokens depend only on its seed
and its own logits, never on the other rows of the batch, the order of the queries or the
device path, and the function has no branch on a tensor's value (it runs inside the
captured static step).

:func:`logprobs` gives the log-probability of the chosen token under the distribution it was
taken from, after the constraint mask and before temperature and the top-k / top-p cuts
(vLLM's "raw logprobs of the processed distribution").

:class:`TokenConstraint` is what structured output (``tokrag_integrations.structured``)
hands the engine: a token mask per step (llguidance's bitmask layout).
"""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass

from .constraints import MASKED_LOGIT, TokenConstraint, allowed_from_bitmask, bitmask_words
from .gumbel import cut_logits, draw, gumbel_noise, logprobs, uniform_noise

__all__ = [
    "MASKED_LOGIT",
    "MAX_TOP_LOGPROBS",
    "Sampling",
    "TokenConstraint",
    "allowed_from_bitmask",
    "bitmask_words",
    "cut_logits",
    "draw",
    "gumbel_noise",
    "logprobs",
    "new_seed",
    "sampling_of",
    "uniform_noise",
]

#: The most alternatives a step records (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20
#: The largest temperature accepted (beyond it every token is about equally likely).
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class Sampling:
    """How one query's tokens are taken from the rule's distribution (see the module
    docstring); built and checked by :func:`sampling_of`."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        """True: the argmax of the rule's distribution (exactly the rule's own token)."""
        return self.temperature == 0.0

    def record(self) -> dict[str, float | int | None]:
        """What the trace records (``Trace.sampling``): empty when greedy."""
        if self.greedy:
            return {}
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
        }


def _number(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    x = float(value)
    if math.isnan(x):
        raise ValueError(f"{name} must be a number {allowed}, got NaN")
    return x


def _integer(name: str, value: object, allowed: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return int(value)


def new_seed() -> int:
    """A fresh seed for a sampled query that was given none (recorded in its trace)."""
    return secrets.randbits(63)


def sampling_of(
    temperature: object = None,
    top_p: object = None,
    top_k: object = None,
    seed: object = None,
    top_logprobs: object = None,
) -> Sampling:
    """A checked :class:`Sampling` from a call's keywords (None: the default); a bad value
    raises a one-sentence ``ValueError`` naming the keyword and its allowed range. A sampled
    query without a seed gets one drawn here (:func:`new_seed`)."""
    t = 0.0 if temperature is None else _number("temperature", temperature, "in [0, 100]")
    if not 0.0 <= t <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {temperature!r}")
    p = 1.0 if top_p is None else _number("top_p", top_p, "in (0, 1]")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1: no cut), got {top_p!r}")
    k = 0 if top_k is None else _integer("top_k", top_k, ">= 0")
    if k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no cut), got {top_k!r}")
    n = 0 if top_logprobs is None else _integer("top_logprobs", top_logprobs, "in [0, 20]")
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}"
        )
    s = None if seed is None else _integer("seed", seed, "(any integer)")
    if t > 0 and s is None:
        s = new_seed()
    return Sampling(temperature=t, top_p=p, top_k=k, seed=s, top_logprobs=n)
