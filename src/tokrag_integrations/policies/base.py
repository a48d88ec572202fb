"""The contract between a decoding rule and the engine that runs it, for policy authors.

A policy has six members: ``name``, ``roles`` (its context roles), :meth:`Policy.contexts`
(one :class:`ContextSpec` per context of a query; ``probe=True`` where the rule reads the
context's per-layer states), :meth:`Policy.prepare` (once per decode, with the model),
:meth:`Policy.choose` and :meth:`Policy.options`. At every step the engine hands
:meth:`Policy.choose` the views of every active query of the batch (one :class:`View` per
context) and a :data:`Lens`; the rule returns one :class:`Choice` per query::

    from tokrag_integrations import generate, load_model
    from tokrag_integrations.policies.base import Choice, Policy

    class Confident(Policy):  # each token from the context surer of its own top token
        name = "confident"
        roles = ("pure", "rag")

        def choose(self, views, lens):
            out = []
            for v in views:
                side = "pure" if v["pure"].probs.max() > v["rag"].probs.max() else "rag"
                out.append(Choice(int(v[side].probs.argmax()), "pure" if side == "pure" else "rag"))
            return out

    r = generate(load_model(), "Who founded Quillfeather?", ["Ottoline Varga founded Quillfeather."],
                 policy=Confident(), max_new_tokens=8)
    assert r.trace.policy == "confident" and set(r.trace.counts()) <= {"agree", "rag", "pure"}

``tokrag_integrations.policies.register_policy("confident", "my_package.rules:Confident")``
then names it for ``policy="confident"`` everywhere (a full dotted module name, imported on
first use).

A rule that reads the lens a few rows at a time (Tok-RAG's l* search) writes one
:data:`Signals` generator per query and runs them with :func:`lens_rounds`. A sequence-level
rule (RAG-Sequence) subclasses :class:`SequencePolicy` instead. How fast a rule is decoded is
not the rule's business: that is ``speed=`` (:class:`..speed.Speed`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..attention.probe import ProbeRecord
from ..models import LoadedModel
from ..prompts import PromptPlan


@dataclass
class ContextSpec:
    """One context of one query: its prompt ids, which positions are retrieved tokens, its
    weight (RAG-Token's p(z|x)) and whether the rule reads its per-layer states (``probe``:
    :attr:`View.record` and the attention rows; only those contexts are probed)."""

    ids: list[int]
    rt_positions: list[int] = field(default_factory=list)
    weight: float | None = None
    probe: bool = False


@runtime_checkable
class View(Protocol):
    """What a rule reads of one context at one step (the engine's ``ContextView``; a test may
    pass any object with these members).

    Shapes: V the vocabulary, L the number of layers, H the heads, T the cached positions.
    """

    #: [V] next-token logits of this context.
    logits: torch.Tensor
    #: The context as the rule's :meth:`Policy.contexts` built it.
    spec: ContextSpec

    @property
    def record(self) -> ProbeRecord | None:
        """Per-layer states of the last position (``resid`` [L+1, 1, d] ...), or None where
        the context is not probed (:attr:`ContextSpec.probe`)."""

    @property
    def probs(self) -> torch.Tensor:
        """[V] softmax of :attr:`logits` (float32)."""

    @property
    def rt_positions(self) -> torch.Tensor:
        """[m] positions of the retrieved tokens, in the coordinates of the attention rows."""

    @property
    def rt_token_ids(self) -> torch.Tensor:
        """[m] token ids at those positions."""

    def attention(self, layer_idx: int) -> torch.Tensor:
        """[H, T] attention of the last position at 0-based layer ``layer_idx``."""

    def attention_all(self) -> torch.Tensor:
        """[L, H, T] attention of the last position at every layer."""


#: ``lens(blocks, final_norm=True)``: the logit lens of hidden-state rows, computed by the
#: engine: one block [R_i, d] per query in, their log-probabilities [R_i, V] (float32) out, in
#: order; ``final_norm`` applies the model's final norm before the LM head. The engine may
#: read the LM head once for all blocks; each block gets the values it gets alone (to rounding).
Lens = Callable[..., list[torch.Tensor]]

#: One query's signals at one step as a generator: it yields the hidden-state rows [R, d]
#: whose logit lens it reads, is sent their log-probabilities [R, V], and returns the signals.
Signals = Generator[torch.Tensor, torch.Tensor, dict[str, Any]]


def lens_rounds(gens: list[Signals], lens: Lens, final_norm: bool) -> list[dict[str, Any]]:
    """Run the :data:`Signals` of several queries to their end: each round, the rows every
    query still asks for go to the engine's ``lens`` in one call."""
    out: list[Any] = [None] * len(gens)
    asks: dict[int, torch.Tensor] = {}

    def send(i: int, value: Any) -> None:
        try:
            asks[i] = gens[i].send(value)
        except StopIteration as done:
            out[i] = done.value

    for i in range(len(gens)):
        send(i, None)
    while asks:
        idx, rows = list(asks), list(asks.values())
        asks.clear()
        for i, logp in zip(idx, lens(rows, final_norm=final_norm), strict=True):
            send(i, logp)
    return out


@dataclass
class Choice:
    """A policy's decision at one step: its token, the token's source, the signals behind
    it, and ``logits`` [V], the distribution the rule took its token from (its argmax is
    ``token_id``). With ``temperature > 0`` the engine draws the token from ``logits``: the
    rule chooses the source, the sampler the token (docs/algorithm.md, "Sampling"). A rule
    that leaves it None keeps its own token whatever the temperature."""

    token_id: int
    source: str
    signals: dict[str, Any] = field(default_factory=dict)
    logits: torch.Tensor | None = None


class Policy:
    """A decoding rule over the engine's step loop (see the module docstring)."""

    #: The rule's registry name (recorded in the trace).
    name: str = ""
    #: Its context roles, in order. ``("pure",)`` alone: the rule reads no passages.
    roles: tuple[str, ...] = ()

    def contexts(self, plan: PromptPlan) -> dict[str, ContextSpec]:
        """The contexts this rule decodes for one query (default: its ``pure`` / ``rag``
        roles, not probed)."""
        out: dict[str, ContextSpec] = {}
        if "pure" in self.roles:
            out["pure"] = ContextSpec(plan.pure_ids)
        if "rag" in self.roles:
            out["rag"] = ContextSpec(plan.rag_ids, plan.retrieved_positions)
        return out

    def prepare(self, lm: LoadedModel) -> None:
        """Called once per decode with the model (cache embeddings, vocabulary masks...)."""

    def choose(self, views: list[dict[str, View]], lens: Lens) -> list[Choice]:
        """The token of every query at this step: ``views`` holds one dict (role -> view)
        per active query of the batch; one :class:`Choice` per query, in order."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The rule's options as recorded in the trace (``Trace.options``)."""
        return {}


class SequencePolicy(Policy):
    """A sequence-level rule: greedy candidates under ``candidate_policy``, each scored under
    every context of :meth:`contexts` by teacher forcing, then :meth:`log_p` picks one (the
    engine reads these members instead of calling ``choose``)."""

    #: The rule decoding the candidates of :meth:`candidate_plans`, and a query without
    #: passages.
    candidate_policy: Policy
    fallback_policy: Policy

    def candidate_plans(self, plan: PromptPlan) -> list[PromptPlan]:
        """The prompts whose greedy answers are the candidates."""
        raise NotImplementedError

    def log_p(self, weights: Sequence[float | None], log_p_contexts: Sequence[float]) -> float:
        """A candidate's score from its log-probability under each context."""
        raise NotImplementedError

    def candidate_source(self, passage: int | None) -> str:
        """The trace source of the tokens of a candidate from ``candidate_plans()[passage]``
        (None: the fallback's)."""
        raise NotImplementedError
