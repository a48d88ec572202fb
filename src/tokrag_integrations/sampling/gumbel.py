"""The draw of a token from a distribution (:func:`draw`: Gumbel-max with counter-based
noise, top-k / top-p cuts) and its log-probabilities (:func:`logprobs`); see the package
docstring. Branch-free on tensor values: it runs inside the captured static step."""

from __future__ import annotations

import torch

__all__ = ["cut_logits", "draw", "gumbel_noise", "logprobs", "uniform_noise"]

_M32 = 0xFFFFFFFF


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


def _tempered(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """z / T ([Q, V] float32; a row with T = 0 is divided by 1)."""
    return logits.float() / torch.where(temperature > 0, temperature.float(), 1.0)[:, None]


def cut_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """z / T with the tokens outside the top-k and the top-p nucleus at -inf ([Q, V] float32;
    a row with T = 0 is divided by 1). Ties at the cut keep every tied token."""
    z = _tempered(logits, temperature)
    V = z.shape[-1]
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
    cut: bool = True,
) -> torch.Tensor:
    """The token of every row ([Q] long) from ``logits`` [Q, V] (the rule's distribution,
    after the constraint mask): the argmax where ``temperature`` [Q] is 0 (bit-exact), else
    Gumbel-max over :func:`cut_logits` with the noise of (``seed`` [Q], ``step`` [Q], v).
    Branch-free; a row's token depends on that row's inputs only. ``cut=False``, for a caller
    that knows no row has a top-k or top-p cut: z / T alone (the same values: the cut then
    keeps every token)."""
    greedy = torch.argmax(logits, dim=-1)
    z = cut_logits(logits, temperature, top_p, top_k) if cut else _tempered(logits, temperature)
    sampled = torch.argmax(z + gumbel_noise(seed, step, z.shape[-1]), dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


def logprobs(
    logits: torch.Tensor, ids: torch.Tensor, k: int, lp: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of ``logits`` [Q, V] at ``ids`` [Q] (-> [Q] float32) and its ``k`` most
    likely tokens (-> ids [Q, k] long, log-probabilities [Q, k] float32); ``lp``: that
    log_softmax where the caller has it already."""
    if lp is None:
        lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, ids.long()[:, None])[:, 0]
    top = torch.topk(lp, k=min(int(k), lp.shape[-1]), dim=-1)
    return chosen, top.indices, top.values
