"""Argmax device rules of the single-source baselines (:mod:`..policies.baselines`: ``llm``,
``rag``, ``floor``) for the static step, used where :mod:`.rules` gives none: the token is
the argmax of the role's logits (``floor``: RAG's, the source ``agree`` where the pure
context's argmax is the same), and the record carries what ``step_event`` writes (each
role's top-1 candidate and its probability, the statistics of
:func:`..engine.stats.distribution_stats_rows`). No citation scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..trace import AGREE, FROM_LLM, FROM_RAG, Candidate
from .step_tensors import DecodedStep, StepTensors

_SOURCES = (AGREE, FROM_RAG, FROM_LLM)
_STATS = ("logp", "entropy", "gini", "mean_logp")
_ROLE_WIDTH = 2 + len(_STATS)


class ArgmaxRule:
    """``llm`` / ``rag`` / ``floor`` on the device (see the module docstring). Record: the
    source code, then per role its top-1 id, its probability and the four statistics."""

    reads: tuple[str, ...] = ()

    def __init__(self, name: str) -> None:
        self.name = name
        self.roles = {"llm": ("pure",), "rag": ("rag",), "floor": ("pure", "rag")}[name]
        self.record_width = 1 + _ROLE_WIDTH * len(self.roles)

    def __call__(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        logits = {r: t.logits.index_select(0, t.rows[r].clamp(min=0)).float() for r in self.roles}
        pick = logits["pure" if self.name == "llm" else "rag"]
        ids = torch.argmax(pick, dim=-1)
        if self.name == "floor":
            agree = torch.argmax(logits["pure"], dim=-1) == ids
            source = torch.where(agree, 0, 1)
        else:
            source = torch.full_like(ids, 2 if self.name == "llm" else 1)
        cols = [source.float()[:, None]]
        for r in self.roles:
            logp = torch.log_softmax(logits[r], dim=-1)
            p = logp.exp()
            clamped = logp.clamp(min=-1e4)
            top = torch.argmax(p, dim=-1)
            cols.append(
                torch.stack(
                    [
                        top.float(),
                        p.gather(1, top[:, None])[:, 0],
                        logp.gather(1, ids[:, None])[:, 0],
                        -(p * clamped).sum(-1),
                        (p * p).sum(-1),
                        clamped.mean(-1),
                    ],
                    dim=1,
                )
            )
        return ids, torch.cat(cols, dim=1)

    def decode(self, record_row: Sequence[float], tokenizer: Any) -> DecodedStep:
        row = [float(x) for x in record_row]
        out = DecodedStep(-1, _SOURCES[int(row[0])])
        for i, r in enumerate(self.roles):
            vals = row[1 + i * _ROLE_WIDTH : 1 + (i + 1) * _ROLE_WIDTH]
            top = int(vals[0])
            out.candidates[r] = Candidate(top, tokenizer.decode([top]), vals[1])
            out.stats[r] = dict(zip(_STATS, vals[2:], strict=True))
        return out


def argmax_rule(policy: Any, lm: Any, *, citations: bool | None) -> ArgmaxRule | None:
    """The argmax rule of ``policy`` where it is exactly ``llm``, ``rag`` or ``floor`` (and
    nothing is cited), else None."""
    from ..policies.baselines import PureLLM, StandardRAG, TwoContextFloor

    kinds = {PureLLM: "llm", StandardRAG: "rag", TwoContextFloor: "floor"}
    name = kinds.get(type(policy))
    if name is None or (citations is True and name != "llm"):
        return None
    return ArgmaxRule(name)
