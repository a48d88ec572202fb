"""The types of the contract between the static decode state and the device rules (issue 56,
item 3): :class:`StepTensors` (one step's tensors), :class:`DeviceRule` and
:class:`DecodedStep`. A leaf module (the rules import it; :mod:`.step_tensors` re-exports
it with :func:`.step_tensors.device_rule_for`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..trace import Candidate, TopLogprob

__all__ = ["MAX_PASSAGES", "DecodedStep", "DeviceRule", "SamplingTensors", "StepTensors"]

#: The citation slots of a record by default: a query with more passages than the rule was
#: built for is not cited on the device (build the rule with ``passages=`` its count).
MAX_PASSAGES = 16


@dataclass
class SamplingTensors:
    """How each query slot's token is taken (:func:`...sampling.draw`), [Q] each."""

    temperature: torch.Tensor  # float32, 0: greedy (the rule's own token)
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # long, 0: no cut
    seed: torch.Tensor  # long
    step: torch.Tensor  # long: the query's step index


@dataclass
class StepTensors:
    """One step of Q queries over R rows (R >= the rows in use; a row no query names is
    ignored). Shapes: V the vocabulary, L the layers, H the heads, d the hidden size, T the
    cache columns, P the retrieved-token slots, K the passage slots."""

    #: [R, V] float32: next-token logits of every row.
    logits: torch.Tensor
    #: [R, L+1, d]: the residual stream at the last position (layer 0 = the embeddings, as
    #: :attr:`..attention.probe.ProbeRecord.resid`); None where no rule reads it.
    resid: torch.Tensor | None
    #: [R, L, H, T]: attention probabilities of the last position at every layer over the T
    #: cache columns (0 where masked); None where no rule reads it.
    attn: torch.Tensor | None
    #: role -> [Q] long: the row of each query's context of that role (``"pure"``, ``"rag"``,
    #: ``"passage:0"``...); -1 where the query has no such context.
    rows: dict[str, torch.Tensor]
    #: [Q, P] long: the ``rag`` context's retrieved-token columns (cache coordinates of its
    #: row), right-padded with 0.
    rt_pos: torch.Tensor
    #: [Q, P] long: the token ids at those columns (pad 0).
    rt_ids: torch.Tensor
    #: [Q, P] bool: which slots hold a retrieved token.
    rt_valid: torch.Tensor
    #: [Q, P] long: the passage index (0-based) of each retrieved token (pad 0).
    rt_passage: torch.Tensor
    #: [Q, K] float: each passage context's prior p(z|x) (``rag_token``; 0 where absent),
    #: else None.
    weights: torch.Tensor | None = None
    #: [Q] long: how many passages each query's citation scores cover (-1: the query is not
    #: cited; 0: cited, with no passage, its citation is []); None: no query is cited. A
    #: query is cited where the engine cites it today (the Decoder's ``_cite``: its ``rag``
    #: context is probed and holds exactly its passages). RAG-Token's citation (every
    #: context a passage) does not read it.
    cite_passages: torch.Tensor | None = None
    #: How each query's token is taken; None: greedy everywhere (the rule's tokens).
    sampling: SamplingTensors | None = None
    #: [Q, V] bool: the tokens each query's constraint allows (True everywhere for an
    #: unconstrained query; every row's logits are masked with it already); None: none.
    allowed: torch.Tensor | None = None
    #: Whether the record holds the ``MAX_TOP_LOGPROBS`` most likely tokens with their
    #: log-probabilities (the step asks for them where a query wants ``top_logprobs``;
    #: else their slots are zeros).
    tops: bool = True
    #: What the rule and the trace parts derive from the logits once a step (a role's
    #: logits, their log-softmax: :func:`.rules.common.role_logits`), shared by both; not an
    #: argument, so that ``dataclasses.replace`` (another step's tensors) starts it empty.
    derived: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, init=False)

    @property
    def num_queries(self) -> int:
        return int(self.rt_pos.shape[0])


@dataclass
class DecodedStep:
    """What the host rebuilds from one record row: the policy's Choice (``token_id``,
    ``source``, ``signals`` exactly as its ``choose`` writes them), and the trace parts of
    the engine's ``step_event`` (each role's top-1 ``candidates``, ``stats`` of
    :func:`..engine.stats.distribution_stats_rows`, the ``citation`` scores or None), and
    the token's ``logprob`` under the rule's distribution with the ``top_logprobs``."""

    token_id: int
    source: str
    signals: dict[str, Any] = field(default_factory=dict)
    candidates: dict[str, Candidate] = field(default_factory=dict)
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    citation: list[float] = field(default_factory=list)
    logprob: float | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@runtime_checkable
class DeviceRule(Protocol):
    """A policy's rule on the device, built once per decode by :func:`device_rule_for`."""

    #: Floats per query in the record.
    record_width: int

    def __call__(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (ids [Q] long, record [Q, record_width] float32, logits [Q, V] float32): the
        chosen tokens (drawn from the rule's distribution where ``t.sampling`` says so),
        everything the trace needs (source code, each role's top-1 candidate and its
        probability, the statistics, the signals, the citation scores, the log-probabilities)
        and the decision logits (the distribution each token was taken from, as
        ``Choice.logits``), computed on the device without a host read and without a branch
        on a tensor's value."""
        ...

    def decode(self, record_row: Sequence[float], tokenizer: Any) -> DecodedStep:
        """Host side, after the one read: one query's :class:`DecodedStep`."""
        ...
