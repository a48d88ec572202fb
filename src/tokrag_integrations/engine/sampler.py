"""The token of every query at a step of the view path, from its rule's choice: the
constraint mask on every context's logits before the rule runs (:meth:`Picker.mask`), then
the token greedy (the rule's own) or drawn from the rule's distribution, its
log-probability and its most likely alternatives (:meth:`Picker.pick`); and after it, the
constraint advanced (:func:`advance_constraint`). The equations are :mod:`..sampling`'s."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..models import LoadedModel
from ..policies.base import Choice
from ..sampling import (
    MASKED_LOGIT,
    Sampling,
    TokenConstraint,
    allowed_from_bitmask,
    bitmask_words,
    draw,
    logprobs,
)
from ..trace import TopLogprob

__all__ = ["GREEDY", "Picked", "Picker", "QuerySampling", "advance_constraint"]


@dataclass
class QuerySampling:
    """How one query's tokens are taken: its :class:`..sampling.Sampling` and its
    constraint (None: free text)."""

    sampling: Sampling
    constraint: TokenConstraint | None = None

    @property
    def plain(self) -> bool:
        """Greedy, unconstrained: exactly the rule's tokens."""
        return self.sampling.greedy and self.constraint is None


#: A greedy unconstrained query (the default).
GREEDY = QuerySampling(Sampling())


@dataclass
class Picked:
    """One query's token at a step, its log-probability (None: the rule gave no
    distribution) and its ``top_logprobs`` alternatives."""

    token_id: int
    logprob: float | None
    top: list[TopLogprob]


class Picker:
    """The view path's tokens from the rule's choices (one per decoder)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._warned = False

    def mask(self, qs: Sequence[QuerySampling], views: Sequence[Mapping[str, Any]]) -> list[torch.Tensor | None]:
        """Apply each constrained query's mask to every one of its contexts' logits (forbidden
        tokens get :data:`..sampling.MASKED_LOGIT`, so that the rule's choice is allowed);
        returns the [V] bool masks (None: unconstrained)."""
        out: list[torch.Tensor | None] = [None] * len(qs)
        idx = [i for i, s in enumerate(qs) if s.constraint is not None and views[i]]
        if not idx:
            return out
        V = int(next(iter(views[idx[0]].values())).logits.shape[-1])
        bitmask = torch.zeros((len(idx), bitmask_words(V)), dtype=torch.int32)
        for j, i in enumerate(idx):
            qs[i].constraint.fill_bitmask(bitmask, j)  # type: ignore[union-attr]
        allowed = allowed_from_bitmask(bitmask, V)
        for j, i in enumerate(idx):
            for v in views[i].values():
                a = allowed[j].to(v.logits.device)
                v.logits = v.logits.float().masked_fill(~a, MASKED_LOGIT)
                v._probs = None
            out[i] = allowed[j]
        return out

    def pick(
        self,
        qs: Sequence[QuerySampling],
        choices: Sequence[Choice],
        allowed: Sequence[torch.Tensor | None],
        steps: Sequence[int],
    ) -> list[Picked]:
        """Every query's token: the rule's own where greedy, else drawn from
        ``Choice.logits`` (masked to the allowed tokens) with the query's seed at its step;
        with its log-probability under that distribution, and its alternatives."""
        out = [Picked(int(c.token_id), None, []) for c in choices]
        need = [i for i, c in enumerate(choices) if c.logits is not None]
        if len(need) < len(choices) and not self._warned:
            if any(not qs[i].sampling.greedy for i, c in enumerate(choices) if c.logits is None):
                self._warned = True
                warnings.warn(
                    "the policy's Choice has no logits: its tokens are kept greedy (set "
                    "Choice.logits to the distribution the rule took its token from)",
                    stacklevel=4,
                )
        if not need:
            return out
        rows = []
        for i in need:
            z = choices[i].logits.float().reshape(-1)  # type: ignore[union-attr]
            a = allowed[i]
            rows.append(z if a is None else z.masked_fill(~a.to(z.device), float("-inf")))
        logits = torch.stack(rows)
        dev = logits.device
        ids = torch.tensor([choices[i].token_id for i in need], dtype=torch.long, device=dev)
        sampled = [j for j, i in enumerate(need) if not qs[i].sampling.greedy]
        if sampled:
            ss = [qs[need[j]].sampling for j in sampled]
            sel = torch.tensor(sampled, dtype=torch.long, device=dev)
            got = draw(
                logits.index_select(0, sel),
                torch.tensor([s.temperature for s in ss], dtype=torch.float32, device=dev),
                torch.tensor([s.top_p for s in ss], dtype=torch.float32, device=dev),
                torch.tensor([s.top_k for s in ss], dtype=torch.long, device=dev),
                torch.tensor([int(s.seed or 0) for s in ss], dtype=torch.long, device=dev),
                torch.tensor([steps[need[j]] for j in sampled], dtype=torch.long, device=dev),
                cut=any(s.top_k > 0 or s.top_p < 1.0 for s in ss),
            )
            ids = ids.index_copy(0, sel, got)
        k = max(qs[i].sampling.top_logprobs for i in need)
        lp, top_ids, top_lp = logprobs(logits, ids, k)
        tok = self.lm.tokenizer
        for j, (tid, x, ti, tl) in enumerate(
            zip(ids.tolist(), lp.tolist(), top_ids.tolist(), top_lp.tolist(), strict=True)
        ):
            n = qs[need[j]].sampling.top_logprobs
            top = [TopLogprob(int(t), tok.decode([int(t)]), float(v)) for t, v in zip(ti[:n], tl[:n], strict=True)]
            out[need[j]] = Picked(int(tid), float(x), top)
        return out


def advance_constraint(s: QuerySampling, token_id: int, eos_ids: Sequence[int]) -> bool:
    """Feed the chosen token to the query's constraint (EOS ends the query anyway and is not
    fed); True where the grammar is complete (the query stops)."""
    c = s.constraint
    if c is None or token_id in eos_ids:
        return False
    c.accept(int(token_id))
    return bool(c.is_finished())
