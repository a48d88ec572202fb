"""The contract between a decoding rule and the loop that runs it, for policy authors.

A policy is a rule over the shared multi-context loop (:mod:`..engine.loop`): it names the
contexts it needs (:meth:`Policy.contexts`, one :class:`ContextSpec` each), and at every step
turns what it sees of them (one :class:`ContextView` per context: next-token logits,
retrieved-token positions, per-layer states and attention rows on demand) into a
:class:`Choice` (the token, where it came from, and the numbers behind the decision)::

    from tokrag_integrations.policies import Choice, Policy, register_policy

    class Confident(Policy):  # each token from the context surer of its own top token
        name = "confident"
        roles = ("pure", "rag")

        def choose(self, views, lm):
            pure, rag = views["pure"].probs, views["rag"].probs
            if pure.max() > rag.max():
                return Choice(int(pure.argmax()), "llm")
            return Choice(int(rag.argmax()), "rag")

    register_policy("confident", "my_package.rules:Confident")

Everything a loop may read from a policy is declared on :class:`Policy` with its default,
so a rule overrides only what it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..attention import ProbeRecord, attention_from_queries, attention_row, cached_keys
from ..prompts import PromptPlan

if TYPE_CHECKING:  # pragma: no cover - typing only (the loop imports this module)
    from ..engine.batch import RoleBatch as _RoleBatch
    from ..engine.loop import StepEvent
    from ..models import LoadedModel

__all__ = ["Choice", "ContextSpec", "ContextView", "Policy"]


@dataclass
class ContextSpec:
    """One context of one query: its prompt ids and which positions are retrieved tokens."""

    ids: list[int]
    rt_positions: list[int] = field(default_factory=list)
    weight: float | None = None


class ContextView:
    """What a policy sees of one context at one step (one row of a role batch).

    ``record`` may be given as a zero-argument callable: it is then built on first access
    (the blockwise loop builds per-layer states only at the steps whose rule reads them).
    ``logits``/``seen_len`` override the batch's latest logits and cache length when the
    view is of an earlier position of a block (the cache then holds later positions too).
    """

    def __init__(
        self,
        batch: _RoleBatch,
        row: int,
        record: ProbeRecord | Callable[[], ProbeRecord] | None,
        *,
        logits: torch.Tensor | None = None,
        seen_len: int | None = None,
    ):
        self._batch = batch
        self._row = row
        self._record = record
        self.logits: torch.Tensor = batch.logits[row] if logits is None else logits
        self.spec: ContextSpec = batch.specs[row]
        self._seen = batch.mask.shape[1] if seen_len is None else seen_len
        self._probs: torch.Tensor | None = None
        self._attn: dict[int, torch.Tensor] = {}
        self._attn_all: torch.Tensor | None = None
        #: Log-probabilities of a rule's first logit-lens rows, computed for several queries
        #: in one product by the rule's ``choose_many`` (None: computed when read).
        self.lens_first: torch.Tensor | None = None

    @property
    def record(self) -> ProbeRecord | None:
        if callable(self._record):
            self._record = self._record()
        return self._record

    @property
    def probs(self) -> torch.Tensor:
        if self._probs is None:
            self._probs = torch.softmax(self.logits.float(), dim=-1)
        return self._probs

    @property
    def rt_positions(self) -> torch.Tensor:
        """Positions of retrieved tokens in cache coordinates (left padding included)."""
        pad = self._batch.pad[self._row]
        return torch.tensor(
            [pad + p for p in self.spec.rt_positions], dtype=torch.long, device=self.logits.device
        )

    @property
    def rt_token_ids(self) -> torch.Tensor:
        ids = self.spec.ids
        return torch.tensor(
            [ids[p] for p in self.spec.rt_positions], dtype=torch.long, device=self.logits.device
        )

    def attention(self, layer_idx: int) -> torch.Tensor:
        """[H, T] attention of the last position at 0-based layer ``layer_idx`` (recomputed)."""
        rec = self.record
        if rec is None:
            raise RuntimeError("this policy did not ask for probe records of this context")
        if layer_idx not in self._attn:
            b, r, seen = self._batch, self._row, self._seen
            keys = cached_keys(b.cache, layer_idx)[b.cache_row(r)][None]
            if keys.shape[2] > seen:  # a full cache holding later positions of a block
                keys = keys[:, :, :seen]
            valid = b.mask[r : r + 1, :seen].bool()
            if rec.query is not None and keys.shape[2] == seen:
                got = attention_from_queries(
                    [rec.query[layer_idx][0]], [rec.query_scale[layer_idx]], [keys], valid, seen  # type: ignore[index]
                )[0]
            else:
                got = attention_row(b.parts, layer_idx, rec, keys, valid, seen)[0]
            self._attn[layer_idx] = got
        return self._attn[layer_idx]

    def attention_all(self) -> torch.Tensor:
        """[L, H, T] attention of the last position at every layer (recomputed in one go)."""
        from ..attention import attention_rows

        if self._attn_all is not None:
            return self._attn_all
        rec = self.record
        if rec is None:
            raise RuntimeError("this policy did not ask for probe records of this context")
        b, r, seen = self._batch, self._row, self._seen
        n = len(b.cache.layers)
        if not b.keeps_every_position():
            return torch.stack([self.attention(i) for i in range(n)])
        cr = b.cache_row(r)
        keys = [cached_keys(b.cache, i)[cr][None] for i in range(n)]
        valid = b.mask[r : r + 1, :seen].bool()
        if rec.query is not None:
            # The forward pass left this position's rotated queries: one q·K per layer.
            out = attention_from_queries(
                [q[0] for q in rec.query], rec.query_scale, keys, valid, seen  # type: ignore[arg-type]
            )
        else:
            out = attention_rows(b.parts, rec, keys, valid, seen)
        for i in range(n):
            self._attn.setdefault(i, out[i])
        self._attn_all = out
        return out


@dataclass
class Choice:
    """A policy's decision at one step."""

    token_id: int
    source: str
    signals: dict[str, Any] = field(default_factory=dict)


class Policy:
    """A decoding rule over the multi-context loop.

    Subclasses set ``name`` and ``roles`` and implement :meth:`choose`. ``probe_roles`` lists
    the roles whose per-layer states the rule reads (only those are probed). The other
    attributes are optional hooks, declared here with the default the loops use.
    """

    name: str = ""
    roles: tuple[str, ...] = ()
    probe_roles: frozenset[str] = frozenset()
    #: Whether the rule needs passages at all (``llm`` does not).
    uses_passages: bool = True
    #: Whether the loop may decode all contexts of the rule as one batch (see
    #: :func:`..accel.packed.fuse_batches`); ``False`` keeps one forward pass per role.
    fuse: bool = True
    #: Decode a pure/RAG rule by blockwise verification (:mod:`..accel.speculative`) where it
    #: applies; ``block`` (None: adaptive) and ``drafter`` (``"auto"``, ``"rag"`` or
    #: ``"pure"``) are that loop's options. Same tokens, sources and signals as step by step.
    speculative: bool = False
    block: int | None = None
    drafter: str = "auto"
    #: A sequence-level rule (RAG-Sequence) that owns its decoding sets this to a method
    #: ``decode(lm, plans, *, max_new_tokens, stop=(), timings=None)`` yielding the loop's
    #: :class:`..engine.loop.StepEvent` objects; None (the default): the loop calls
    #: :meth:`choose` at every step.
    decode: Callable[..., Iterator[StepEvent]] | None = None

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        """The contexts this rule decodes for one query (default: pure and RAG)."""
        out: dict[str, ContextSpec] = {}
        if "pure" in self.roles:
            out["pure"] = ContextSpec(plan.pure_ids)
        if "rag" in self.roles:
            out["rag"] = ContextSpec(plan.rag_ids, plan.retrieved_positions)
        return out

    def prepare(self, lm: LoadedModel) -> None:
        """Called once per decode with the model (cache embeddings etc.)."""

    def choose(self, views: dict[str, ContextView], lm: LoadedModel) -> Choice:
        """The token to emit at this step, given one view per context role."""
        raise NotImplementedError

    def choose_many(self, views: list[dict[str, ContextView]], lm: LoadedModel) -> list[Choice]:
        """:meth:`choose` for several queries at the same step (a batched decode), in order.
        A rule may override it to share work between the queries; the choices must be those
        :meth:`choose` makes for each on its own."""
        return [self.choose(v, lm) for v in views]

    def options(self) -> dict[str, Any]:
        """The rule's options as recorded in the trace (``Trace.options``)."""
        return {}
