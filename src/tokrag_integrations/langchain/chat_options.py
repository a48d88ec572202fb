"""``ChatTokRAG``'s sampling and log-probability options (ChatOpenAI's names) as the engine's
keywords, and the engine's log-probabilities as ChatOpenAI's ``response_metadata["logprobs"]``.

``temperature`` / ``top_p`` / ``top_k`` / ``seed`` go to the engine unchanged
(:func:`tokrag_integrations.sampling.sampling_of` checks them): ``temperature`` absent or 0 is
today's greedy decoding. ``logprobs=True`` puts ``{"content": [...]}`` (OpenAI's
content-logprob shape: ``token``, ``logprob``, ``bytes``, ``top_logprobs``) in the answer's
metadata; ``top_logprobs=k`` (0..20, with ``logprobs=True``) asks the engine for the ``k`` best
alternatives of each step. The log-probability is the chosen token's under the distribution
the policy took it from (docs/algorithm.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..sampling import sampling_of
from ..trace import TraceStep

#: ChatTokRAG's fields and call keywords of this module, in the engine's order.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs")


def sampling_options(values: Mapping[str, Any]) -> dict[str, Any]:
    """The engine keywords of ``values`` (a model's fields with a call's keywords over them):
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``top_logprobs``; the ones not set are
    left out (the engine's defaults: greedy).

    Raises:
        ValueError: a value outside its range (one sentence naming it), or ``top_logprobs``
            without ``logprobs=True``.
    """
    top = values.get("top_logprobs")
    if top and not values.get("logprobs"):
        raise ValueError(
            f"top_logprobs={top!r} needs logprobs=True (as in ChatOpenAI): pass both"
        )
    sampling_of(
        temperature=values.get("temperature"),
        top_p=values.get("top_p"),
        top_k=values.get("top_k"),
        seed=values.get("seed"),
        top_logprobs=top,
    )  # checks every value, before a model is loaded
    out = {k: values[k] for k in ("temperature", "top_p", "top_k", "seed") if values.get(k) is not None}
    if values.get("logprobs"):
        out["top_logprobs"] = int(top or 0)
    return out


def step_logprob(step: TraceStep) -> dict[str, Any]:
    """One generated token's entry of ``logprobs["content"]`` (OpenAI's shape), as
    ``GenerationResult.logprobs`` gives each (a stream has its steps, not the result, until
    its end)."""

    def entry(text: str, logprob: float | None) -> dict[str, Any]:
        return {
            "token": text,
            "logprob": float(logprob) if logprob is not None else None,
            "bytes": list(text.encode("utf-8")),
        }

    return {
        **entry(step.text, step.logprob),
        "top_logprobs": [entry(t.text, t.logprob) for t in step.top_logprobs],
    }


def logprobs_metadata(steps: list[TraceStep]) -> dict[str, Any]:
    """``response_metadata["logprobs"]`` of streamed ``steps`` (the chunks' lists add up to
    the answer's)."""
    return {"logprobs": {"content": [step_logprob(s) for s in steps]}}
