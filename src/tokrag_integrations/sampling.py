"""Sampling and log-probabilities of the engine's tokens (issue 57), a leaf module: torch
and the standard library only, so that the engine and the device step (``accel``) share it.

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
from typing import Protocol, runtime_checkable

import torch

__all__ = [
    "MAX_TOP_LOGPROBS",
    "Sampling",
    "TokenConstraint",
    "allowed_from_bitmask",
    "bitmask_words",
    "draw",
    "logprobs",
    "new_seed",
    "sampling_of",
]

#: The most alternatives a step records (OpenAI's limit for ``top_logprobs``).
MAX_TOP_LOGPROBS = 20
#: The largest temperature accepted (beyond it every token is about equally likely).
MAX_TEMPERATURE = 100.0
#: What a token the constraint forbids gets in the contexts' logits before the rule runs: a
#: finite number, so that a rule's arithmetic on logits (CAD's (1 + α)·z_RAG − α·z_LLM) stays
#: finite, far below any real logit, so that its probability is exactly 0 in float32.
MASKED_LOGIT = -1e30

_M32 = 0xFFFFFFFF


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


# ---------------------------------------------------------------------- the noise
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for int64 ``x`` in [0, 2^32) without overflowing int64 (the halves
    of ``x`` multiplied apart): the same bits on every device."""
    lo = x & 0xFFFF
    hi = x >> 16
    return ((lo * c) + (((hi * c) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32") of int64 ``x`` in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """u [Q, V] in (0, 1), float32: a hash of (seed [Q], step [Q], token index v)."""
    seed = seed.long()
    key = _hash32(seed & _M32)
    key = _hash32(key ^ ((seed >> 32) & _M32))
    key = _hash32(key ^ (step.long() & _M32))
    v = torch.arange(vocab, device=seed.device, dtype=torch.long)
    h = _hash32(key[:, None] ^ v[None, :])
    h = _hash32(h ^ 0x9E3779B9)
    # 23 bits and a half: exact in float32 (24-bit significand), strictly inside (0, 1).
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """g = -log(-log u), [Q, V] float32 (:func:`uniform_noise`)."""
    u = uniform_noise(seed, step, vocab)
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------- draw
def cut_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """z / T with the tokens outside the top-k and the top-p nucleus at -inf ([Q, V] float32;
    a row with T = 0 is divided by 1). Ties at the cut keep every tied token."""
    z = logits.float()
    Q, V = z.shape
    t = torch.where(temperature > 0, temperature.float(), 1.0)
    z = z / t[:, None]
    srt, _ = torch.sort(z, dim=-1, descending=True)
    ranks = torch.arange(V, device=z.device)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V).long()
    in_k = ranks[None, :] < k[:, None]
    p = torch.softmax(torch.where(in_k, srt, float("-inf")), dim=-1)
    before = torch.cumsum(p, dim=-1) - p  # mass of the better tokens
    n_p = ((before < top_p.float()[:, None]) & in_k).sum(-1)
    n = torch.where(top_p >= 1.0, k, torch.minimum(n_p, k)).clamp(min=1)
    threshold = srt.gather(1, (n - 1)[:, None])
    return torch.where(z >= threshold, z, float("-inf"))


def draw(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
) -> torch.Tensor:
    """The token of every row ([Q] long) from ``logits`` [Q, V] (the rule's distribution,
    after the constraint mask): the argmax where ``temperature`` [Q] is 0 (bit-exact), else
    Gumbel-max over :func:`cut_logits` with the noise of (``seed`` [Q], ``step`` [Q], v).
    Branch-free; a row's token depends on that row's inputs only."""
    greedy = torch.argmax(logits, dim=-1)
    z = cut_logits(logits, temperature, top_p, top_k)
    sampled = torch.argmax(z + gumbel_noise(seed, step, z.shape[-1]), dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def logprobs(
    logits: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of ``logits`` [Q, V] at ``ids`` [Q] (-> [Q] float32) and its ``k`` most
    likely tokens (-> ids [Q, k] long, log-probabilities [Q, k] float32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, ids.long()[:, None])[:, 0]
    top = torch.topk(lp, k=min(int(k), lp.shape[-1]), dim=-1)
    return chosen, top.indices, top.values


# ---------------------------------------------------------------------- constraints
def bitmask_words(vocab: int) -> int:
    """int32 words per row of a token bitmask over ``vocab`` tokens."""
    return (int(vocab) + 31) // 32


def allowed_from_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, ceil(V/32)] int32 (bit j of word i allows token 32·i + j) -> [N, V] bool."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@runtime_checkable
class TokenConstraint(Protocol):
    """A token mask per step (structured output; ``tokrag_integrations.structured``)."""

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row ``index`` of an int32 [N, ceil(V/32)]
        bitmask (bit j of word i allows token 32·i + j)."""
        ...

    def accept(self, token_id: int) -> None:
        """The chosen token (raises if it is not allowed)."""
        ...

    def is_finished(self) -> bool:
        """The grammar is complete: the query stops."""
        ...

    def fork(self) -> TokenConstraint:
        """A fresh copy at the start (one per query of ``n > 1``)."""
        ...
