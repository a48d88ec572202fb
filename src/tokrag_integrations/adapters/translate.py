"""Framework-free translation shared by the LlamaIndex and LangChain adapters and the server
(finish reasons, token usage)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine import scheduler
from ..models import LoadedModel

#: The core's stop reasons as the ``finish_reason`` values of chat APIs (OpenAI's).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def decode_on(lm: Any, how: str, query: str, passages: Any, *, batching: bool, **kw: Any) -> Any:
    """``how`` (generate, stream, agenerate, astream_with_result) on ``lm``: a local
    :class:`LoadedModel` through the scheduler, or a server's ``RemoteModel`` (``base_url=``)."""
    if isinstance(lm, LoadedModel):
        return getattr(scheduler, how)(lm, query, passages, batching=batching, **kw)
    return getattr(lm, how)(query, passages, **kw)


def usage(result: Any, roles: Sequence[str] | None = None) -> dict[str, Any]:
    """Token usage of one decode, the one count of the adapters and the server (OpenAI
    ``usage``, LangChain ``usage_metadata``, LlamaIndex ``raw["usage"]``): ``prompt_tokens``
    counts the prompt of every context the policy decoded (by its context ``roles``, looked up
    by the trace's policy name if None): both the pure and the RAG prompt for Tok-RAG and CAD,
    the RAG prompt for ``rag`` (it stands in for per-passage rules), the pure one for ``no_rag``
    and when no passage was usable; ``completion_tokens`` one per step; with ``total_tokens``
    and ``prompt_tokens_by_context`` (the trace's ``prompt_tokens``).
    """
    from ..policies import get_policy

    tr = result.trace
    prompt = {k: int(v or 0) for k, v in tr.prompt_tokens.items()}
    if roles is None:
        try:
            roles = get_policy(tr.policy).roles
        except (KeyError, ValueError, TypeError):
            roles = ()
    used = set(roles) & {"pure", "rag"} or {"rag"}
    if not prompt.get("rag"):
        used = {"pure"}
    n_in = sum(prompt.get(r, 0) for r in used)
    n_out = len(tr.steps)
    return {
        "prompt_tokens": n_in,
        "completion_tokens": n_out,
        "total_tokens": n_in + n_out,
        "prompt_tokens_by_context": prompt,
    }


def result_summary(result: Any) -> dict[str, Any]:
    """A result's provenance: policy, counts per source, stop reason, warnings, model."""
    tr = result.trace
    return {
        "policy": tr.policy,
        "counts": result.counts,
        "stop_reason": tr.stop_reason,
        "warnings": list(tr.warnings),
        "model": tr.model,
    }


def gate_summary(decision: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(a gate decision's dict without ``details``, its details without the draft's result
    and tokens)."""
    d = decision.to_dict()
    details = {k: v for k, v in d.pop("details", {}).items() if k not in ("result", "tokens")}
    return d, details


def model_label(spec: Any) -> Any:
    """What a ``model`` field holds for a model spec: a name or path as given, a
    ``LoadedModel``'s name, a loaded object's class name."""
    from ..models import LoadedModel

    if isinstance(spec, LoadedModel):
        return spec.name
    if isinstance(spec, os.PathLike):
        return str(spec)
    return spec if isinstance(spec, str) or spec is None else type(spec).__name__


def given_options(**options: Any) -> dict[str, Any]:
    """The load options actually set (None, False and empty dicts dropped)."""
    return {k: v for k, v in options.items() if v is not None and v is not False and v != {}}


def options_dict(policy_options: Any) -> dict[str, Any]:
    """``policy_options`` as a dict (None: empty); anything but a mapping is refused."""
    if policy_options is not None and not isinstance(policy_options, Mapping):
        raise TypeError(
            "policy_options must be a dict of option names to values, got "
            f"{type(policy_options).__name__}"
        )
    return dict(policy_options or {})


def checked_policy(
    policy: Any, options: dict[str, Any], owner: str, accepted: Sequence[str]
) -> Any:
    """The policy built by the registry, which checks ``options``: an unknown policy or
    option fails when the adapter is made, not at its first call (an unknown option as a
    ``TypeError`` naming ``owner``'s own arguments)."""
    from ..policies import get_policy

    try:
        return get_policy(policy, **options)
    except ValueError as e:
        if "unknown option" not in str(e):
            raise
        raise TypeError(
            f"{owner}: {e}. policy_options={{...}} holds the policy's options; {owner}'s own "
            f"arguments are: {', '.join(accepted)}"
        ) from e
