"""The contract between a decoding rule and the loop that runs it, for policy authors.

A policy is a rule over the shared multi-context loop (:mod:`..engine.loop`): it names the
contexts it needs (:meth:`Policy.contexts`, one :class:`ContextSpec` each), and at every step
turns what it sees of them (one :class:`View` per context, the engine's
:class:`..engine.view.ContextView`: next-token logits, retrieved-token positions, per-layer
states and attention rows on demand) into a :class:`Choice` (the token, where it came from,
and the numbers behind the decision)::

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
so a rule overrides only what it changes. How fast a rule is decoded is not the rule's
business: that is the ``speed=`` of the runner and the API (:class:`..engine.speed.Speed`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..attention import ProbeRecord
from ..models import LoadedModel
from ..prompts import PromptPlan
from .legacy_speed import add_speed_properties

__all__ = ["Choice", "ContextSpec", "Policy", "View"]


def __getattr__(name: str) -> Any:
    # ``ContextView`` moved to the engine (:mod:`..engine.view`): rules are written against
    # :class:`View`. Resolved at run time so that this module never imports the engine (the
    # engine imports it).
    if name == "ContextView":
        return importlib.import_module("..engine.view", __package__).ContextView
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class ContextSpec:
    """One context of one query: its prompt ids and which positions are retrieved tokens."""

    ids: list[int]
    rt_positions: list[int] = field(default_factory=list)
    weight: float | None = None


@runtime_checkable
class View(Protocol):
    """What a rule reads of one context at one step (the engine's
    :class:`..engine.view.ContextView` is the implementation; a test may pass any object with
    these members).

    Shapes: V the vocabulary, L the number of layers, H the heads, T the cached positions.
    """

    #: [V] next-token logits of this context.
    logits: torch.Tensor
    #: The context's prompt ids and retrieved positions (as the rule's :meth:`Policy.contexts`
    #: built it).
    spec: ContextSpec
    #: [R, V] log-probabilities of the rule's first logit-lens rows when the engine computed
    #: them for several queries in one product (:meth:`Policy.first_lens_rows`), else None.
    lens_first: torch.Tensor | None

    @property
    def record(self) -> ProbeRecord | None:
        """Per-layer states of the last position (``resid`` [L+1, 1, d] ...), or None where
        the rule did not ask for them (:attr:`Policy.probe_roles`)."""

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
    #: A sequence-level rule (RAG-Sequence) is not decided token by token: the engine decodes
    #: it with :func:`..engine.sequence.decode_sequence`, which calls the rule's own
    #: equations; :meth:`choose` is never called.
    sequence_level: bool = False
    #: A rule that owns its decoding altogether may set this to a method
    #: ``decode(lm, plans, *, max_new_tokens, stop=(), timings=None)`` yielding the loop's
    #: ``StepEvent`` objects; None (the default): the loop calls :meth:`choose` at every step.
    decode: Callable[..., Iterator[Any]] | None = None
    #: Speed options given to the rule the old way (``TokRAG(speculative=True)``); the runner
    #: reads them where no ``speed=`` is given. Deprecated: pass ``speed=`` instead.
    legacy_speed: dict[str, Any] = {}  # noqa: RUF012 - never mutated, replaced per instance

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

    def choose(self, views: dict[str, View], lm: LoadedModel) -> Choice:
        """The token to emit at this step, given one view per context role."""
        raise NotImplementedError

    def choose_many(self, views: list[dict[str, View]], lm: LoadedModel) -> list[Choice]:
        """:meth:`choose` for several queries at the same step, in order (the engine's
        batched chooser shares the rows of :meth:`first_lens_rows` between them first)."""
        return [self.choose(v, lm) for v in views]

    def choice_without_signals(self, views: dict[str, View]) -> Choice | None:
        """The choice :meth:`choose` makes at this step without reading the model's layers (the
        contexts agree, a gated word, ...), or None where it reads them (the default). The
        engine's batched chooser asks this first and takes the answer as the step's choice."""
        return None

    def first_lens_rows(self, views: dict[str, View]) -> torch.Tensor | None:
        """[R, d] hidden-state rows whose logit lens the rule reads first at this step, or None
        where it reads none (the default); asked only where :meth:`choice_without_signals` is
        None. Where several queries of a batch return rows, the engine lenses them in one
        product and hands each query its part as ``views["rag"].lens_first``; the rule must
        then read the same values it would have computed itself."""
        return None

    #: Whether :meth:`first_lens_rows` are lensed with the final norm.
    lens_norm: bool = True

    def options(self) -> dict[str, Any]:
        """The rule's options as recorded in the trace (``Trace.options``)."""
        return {}


# Deprecated: ``policy.fuse``, ``policy.speculative``, ``policy.block``, ``policy.drafter``
# (speed choices, now the ``speed=`` of the runner and the API), see :mod:`.legacy_speed`.
add_speed_properties(Policy)
