"""The captured step of the static decode state (:mod:`.static_state`, issue 56; sampling and
constraints, issue 57): the model's forward on one token per row (:mod:`.static_forward`),
the constraint masks, the policy's device rule (its token greedy or drawn, and the
log-probabilities: :class:`.rules.common.RecordRule`), then the next-step update; no host
read and no branch on a tensor's value, so that ``torch.compile`` captures it
(:func:`_compiled`, one compiled function per mode)."""

from __future__ import annotations

from typing import Any

import torch

from ..sampling import MASKED_LOGIT, allowed_from_bitmask
from .static_forward import static_forward
from .step_types import SamplingTensors, StepTensors

__all__ = ["static_step"]


def static_step(
    model: Any,
    rule: Any,
    pad_id: int,
    resid: bool,
    attn: bool,
    sample: bool,
    masked: bool,
    tops: bool,
    direct: bool,
    ids: torch.Tensor,
    pos: torch.Tensor,
    valid: torch.Tensor,
    col: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    row_q: torch.Tensor,
    rows: dict[str, torch.Tensor],
    rt_pos: torch.Tensor,
    rt_ids: torch.Tensor,
    rt_valid: torch.Tensor,
    rt_passage: torch.Tensor,
    cite_n: torch.Tensor,
    weights: torch.Tensor | None,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    bits: torch.Tensor,
    constrained: torch.Tensor,
    slots: int | None = None,
) -> torch.Tensor:
    """The captured step: forward + probes + the constraint masks (``masked``: every row's
    logits masked by its query's allowed tokens before the rule) + the device rule (its
    token drawn from its distribution where ``sample``; the log-probabilities, and the most
    likely tokens' where ``tops``: some query asks for ``top_logprobs``; ``direct``: the
    layers written out, :func:`.static_forward.direct_off_reason`) + the
    next-step update, on the buffers of a :class:`StaticBuffers` (passed one by one, so a
    compiler sees plain tensors). ``slots``: how many query slots can hold a query (the
    first ``slots``; None: all), the only ones the rule computes. Returns [slots, 1 + K]
    float32: each query slot's chosen id, then its record."""
    if slots is not None:  # the slots no query can take cost the rule nothing
        rows = {r: x[:slots] for r, x in rows.items()}
        rt_pos, rt_ids = rt_pos[:slots], rt_ids[:slots]
        rt_valid, rt_passage, cite_n = rt_valid[:slots], rt_passage[:slots], cite_n[:slots]
        weights = None if weights is None else weights[:slots]
        temperature, top_p, top_k = temperature[:slots], top_p[:slots], top_k[:slots]
        seed, bits, constrained = seed[:slots], bits[:slots], constrained[:slots]
    step_q = step if slots is None else step[:slots]
    valid.index_fill_(1, col.view(1), True)  # every row sees the column it writes
    logits, res, probs = static_forward(
        model, ids, pos, valid, col, keys, values, resid=resid, attn=attn, direct=direct
    )
    allowed = None
    if masked:
        allowed = allowed_from_bitmask(bits, logits.shape[-1]) | ~constrained[:, None]
        row_ok = allowed.index_select(0, row_q.clamp(min=0))
        logits = torch.where(row_ok, logits, MASKED_LOGIT)
    t = StepTensors(
        logits=logits,
        resid=res,
        attn=probs,
        rows=rows,
        rt_pos=rt_pos,
        rt_ids=rt_ids,
        rt_valid=rt_valid,
        rt_passage=rt_passage,
        weights=weights,
        cite_passages=cite_n,
        sampling=SamplingTensors(temperature, top_p, top_k, seed, step_q) if sample else None,
        allowed=allowed,
        tops=tops,
    )
    chosen, record, _ = rule(t)
    nxt = chosen.index_select(0, row_q.clamp(min=0))
    ids.copy_(torch.where(row_q >= 0, nxt, pad_id))
    pos.add_(1)
    col.add_(1)
    step.add_(1)
    return torch.cat([chosen.to(torch.float32)[:, None], record.float()], dim=1)


_COMPILED: dict[str | None, Any] = {}
#: The compiled step's entries (policies x their flags x static / dynamic shapes).
RECOMPILE_LIMIT = 64


def _compiled(mode: str | None) -> Any:
    """:func:`static_step` compiled with ``mode`` (one compiled function per mode, so that
    every decode reuses its graphs)."""
    if mode not in _COMPILED:
        # One code object serves every policy (its rule and flags are guarded constants) and
        # shape (automatic dynamic after the first change): more entries than dynamo's
        # default of 8 before it would fall back to eager.
        dyn = torch._dynamo.config
        dyn.recompile_limit = max(dyn.recompile_limit, RECOMPILE_LIMIT)
        _COMPILED[mode] = torch.compile(static_step, mode=mode)
    return _COMPILED[mode]
